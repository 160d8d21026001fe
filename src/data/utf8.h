// UTF-8 validity (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF): prepare-data
// refuses text that is not UTF-8, so a tokenizer never sees bytes it would silently replace.
#pragma once

#include <cstddef>
#include <string_view>

namespace malleus::data {

// The offset of the first byte that does not begin or continue a valid UTF-8 sequence (for a
// sequence cut short by the end of the text: its first byte), or std::string_view::npos when the
// whole text is valid.
size_t invalid_utf8_offset(std::string_view text);

}  // namespace malleus::data
