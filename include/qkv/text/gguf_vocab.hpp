// A Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) as the GGUF metadata llama.cpp reads:
// tokenizer.ggml.* and tokenizer.chat_template, written as llama.cpp's convert_hf_to_gguf.py writes them, so a GGUF
// file qkv makes from a folder tokenizes in llama.cpp as the folder does. Not here: reading that metadata back
// (HfTokenizer::from_gguf), the rest of the file (nn/gguf_export.hpp).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "qkv/io/gguf.hpp"

namespace qkv::text {

// The tokenizer metadata of the folder `dir`, in the order convert writes it: tokenizer.ggml.model ("gpt2" for a
// byte-level BPE, "llama" for a SentencePiece-style BPE with byte fallback), .pre (named from the hash of how the
// tokenizer splits convert's test text, else from its Split regexes), .tokens, .scores (SentencePiece only), .token_type,
// .merges (byte-level only), the special ids (bos, eos, unk, sep, pad, cls, mask) found among the added tokens,
// add_bos_token / add_eos_token, and tokenizer.chat_template. IoError naming the folder when it has no tokenizer.json,
// or a pre-tokenizer llama.cpp would not know (convert_hf_to_gguf.py refuses those too).
std::vector<std::pair<std::string, io::GgufValue>> gguf_tokenizer_metadata(const std::string& dir);

// The SHA-256 of `message`, as lower-case hex (FIPS 180-4): convert_hf_to_gguf.py names pre-tokenizers by it.
std::string sha256_hex(const std::string& message);

}  // namespace qkv::text
