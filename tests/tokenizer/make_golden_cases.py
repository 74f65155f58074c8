#!/usr/bin/env python3
"""Produces testdata/hf_golden_cases.json with the Hugging Face `tokenizers` library.

The C++ tests compare against these ids, so the reference comes from an independent
implementation. Run once where `tokenizers` is installed:
  python3 make_golden_cases.py path/to/tokenizer.json > testdata/hf_golden_cases.json
"""
import json
import random
import sys

from tokenizers import Tokenizer

HANDPICKED = [
    " ", "  ", "   ", "\n", "\n\n", "\n\n\n", " \n", "  \n", "\n ", "\n  x", " \n \n ",
    "a  b", "a   b", "a\n\nb", "a \n b", "a\t\tb", "\r\n\r\n", "\r", "x \r\n y", "x\n\n\n  y",
    "1", "12", "1234567890", "3.14159", "x1y2z3", "٣٤٥", "Ⅻ", "½ ¼", "²³",
    "it's", "IT'S", "We'LL", "you'Re", "I'D", "he'ſ", "'s", "''s", "'", "a'b", "don't!",
    "中文测试", "日本語のテキスト", "한국어 텍스트", "한국어", "\u1100\u1161\u11a8",
    "e\u0301", "cafe\u0301", "A\u030a", "\u0301abc", "  \u0301", "n\u0303o", "\u00c5\u212b",
    "👨‍👩‍👧‍👦", "🇺🇸🇫🇷", "a😀b", " 😀 ", "😀😀😀", "\u2764\ufe0f",
    "\u00a0", "a\u00a0b", "\u3000", "a\u3000b", "a\u2028b", "a\u0085b", "a\u180eb",
    "a\u200bb", "a\ufeffb", "\u2003\u2003x", "x\u2003\u2003",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "x<|im_end|>y", " <|im_end|> ",
    "<|im_start|><|im_end|>", "<|im_start", "<|im_start|>system\nYou are helpful.<|im_end|>",
    "<tool_call>\n{}\n</tool_call>", "<think>\nhmm\n</think>", "<|fim_prefix|>a<|fim_suffix|>",
    "hello<|endoftext|>world", "<|<|im_end|>|>",
    "ﬁ ligature", "Ⓐ", "Ǆ", "İstanbul", "ΣΊΣΥΦΟΣ", "ß", "ǅungla",
    "$$$", "...", "—", "–-", "«»", "\"quoted\"", "C++ <vector>", "a_b_c", "__init__",
    "x = y + 1;  // comment", "    def f():\n        pass\n", "\t\tif (x) {\n\t\t\treturn;\n\t\t}",
    "http://a.b/c?d=e", "user@example.com", "#hashtag @mention", "1e10 0x1F 0b101",
    "\x00", "a\x00b", "\x7f", "\x1b[31mred\x1b[0m",
]

POOL = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") +
        list("0123456789") + list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") +
        [" ", " ", " ", "  ", "\n", "\n\n", "\r\n", "\t", "\r"] +
        ["the", " the", "ing", " and", "token", "'s", "'S", "'ll", "'VE", "'d", "'M", "'t"] +
        list("你好世界中文こんにちはカタカナ한국어ПриветмирمرحباΑλφα") +
        ["😀", "🎉", "👍🏽", "👨‍👩‍👧", "🇯🇵", "\u0301", "\u0308", "\u0327", "\u00a0", "\u3000",
         "\u2028", "\u0085", "\u180e", "\u200b", "\u2003", "٣", "Ⅻ", "½", "²", "ſ", "K",
         "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "<|", "|>"])


def random_pool_string(rng):
    return "".join(rng.choice(POOL) for _ in range(rng.randint(1, 30)))


def random_codepoint_string(rng):
    out = []
    for _ in range(rng.randint(1, 12)):
        while True:
            cp = rng.choice([rng.randint(0x20, 0x7f), rng.randint(0x80, 0x7ff),
                             rng.randint(0x800, 0xffff), rng.randint(0x10000, 0x2ffff)])
            if not 0xd800 <= cp <= 0xdfff:
                break
        out.append(chr(cp))
        if rng.random() < 0.3:
            out.append(" ")
    return "".join(out)


INVALID_BYTES = [b"\xff", b"a\xffb", b"\xc3", b"\xc3(", b"\xe2\x82", b"\xe2\x82(", b"\xed\xa0\x80",
                 b"\xf0\x9f\x98", b"\xf0\x9f\x98 x", b"\xc0\xaf", b"\xf8\x88\x80\x80\x80",
                 b"caf\xe9", b"\x80\x80\x80", b"\xf4\x90\x80\x80", b"ok\xe4\xbd\xa0\xe5"]


def main():
    tok = Tokenizer.from_file(sys.argv[1])
    rng = random.Random(20251130)
    texts = list(HANDPICKED)
    texts += [random_pool_string(rng) for _ in range(400)]
    texts += [random_codepoint_string(rng) for _ in range(200)]
    cases = []
    for text in texts:
        ids = tok.encode(text).ids
        cases.append({"text": text, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)})
    invalid = []
    for raw in INVALID_BYTES:
        ids = tok.encode(raw.decode("utf-8", errors="replace")).ids
        invalid.append({"bytes_hex": raw.hex(), "ids": ids})
    vocab = tok.get_vocab_size(with_added_tokens=True)
    decodes = []
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        decodes.append({"ids": ids, "text": tok.decode(ids, skip_special_tokens=False)})
    json.dump({"encode": cases, "invalid_utf8": invalid, "decode": decodes,
               "vocab_size_with_added": vocab}, sys.stdout, ensure_ascii=True, indent=0)


if __name__ == "__main__":
    main()
