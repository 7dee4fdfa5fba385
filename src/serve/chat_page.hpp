// The chat page at `/` (chat_page.cpp): one static HTML file. Private to the server.
#pragma once

namespace qkv::serve {

const char* chat_page_html();  // the whole page, UTF-8

}  // namespace qkv::serve
