"""The pre-tokenizers of the byte-level BPE vocabularies a GGUF file names
in `tokenizer.ggml.pre`: the splits llama.cpp applies before BPE, rebuilt
as `tokenizers` pre-tokenizers (a Split per regex, each over the pieces the
one before left, as llama.cpp runs its list), then the byte-level map."""
from __future__ import annotations

import functools
import sys
import unicodedata

from tokenizers import Regex, pre_tokenizers

# Split regexes of the vocabularies llama.cpp names in tokenizer.ggml.pre.
# Llama 3 and Qwen2 differ only in how many digits stay together.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (gpt-oss, GPT-4o): words split where case turns (an upper run, then
# lower letters), English contractions kept on the word, digits in threes.
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek V3 / R1: digits in threes and runs of CJK split off first, then
# words (a symbol may lead a Latin word), symbol runs, newlines, spaces.
_DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# DeepSeek LLM / V2 / V2.5 (`deepseek-llm`): newlines alone; a run of
# DeepSeek's letters with one space before it; a run of ASCII, full-width
# and quotation punctuation, likewise; trailing spaces; a run of CJK (with
# DeepSeek's wide range before it, U+0800-U+4E00); digit runs. The letters
# are _deepseek_letters().
_DEEPSEEK_LLM_PUNCT = r"!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}"
_DEEPSEEK_LLM_CJK = r"\x{4E00}-\x{9FA5}\x{0800}-\x{4E00}\x{AC00}-\x{D7FF}"

# DeepSeek's letter class is Unicode's cased letters (Lu, Ll, Lt) less
# these blocks' (their tokenizer leaves them out; llama.cpp keeps the same
# class): Armenian's small letters; Georgian but for Mtavruli and
# Asomtavruli's first 38 capitals (to U+10C5); Cyrillic Extended-C; Latin
# Extended-D from U+A790;
# Latin Extended-E (not Cherokee's small letters after it); Vithkuqi;
# Medefaidrin; the mathematical alphanumerics; Latin Extended-G.
_DEEPSEEK_NOT_LETTERS = ((0x0560, 0x058F), (0x10C7, 0x10C7), (0x10CD, 0x10FF), (0x1C80, 0x1C8F),
                         (0x2D00, 0x2D2F), (0xA790, 0xA7FF), (0xAB30, 0xAB6F), (0x10570, 0x105BF),
                         (0x16E40, 0x16E9F), (0x1D400, 0x1D7FF), (0x1DF00, 0x1DFFF))
# How many code points DeepSeek's class holds: the Unicode database this
# Python carries must give the same (a later one adds cased letters).
DEEPSEEK_LETTER_COUNT = 2729


@functools.cache
def _deepseek_letters() -> str:
    """DeepSeek's letter class as a regex class body of code-point ranges."""
    def letter(c: int) -> bool:
        return (unicodedata.category(chr(c)) in ("Lu", "Ll", "Lt")
                and not any(a <= c <= b for a, b in _DEEPSEEK_NOT_LETTERS))
    ranges: list[list[int]] = []
    count = 0
    for c in range(sys.maxunicode + 1):
        if letter(c):
            count += 1
            if ranges and ranges[-1][1] == c - 1:
                ranges[-1][1] = c
            else:
                ranges.append([c, c])
    if count != DEEPSEEK_LETTER_COUNT:
        raise ValueError(f"the 'deepseek-llm' pre-tokenizer's letters: Unicode {unicodedata.unidata_version} gives "
                         f"{count} cased letters outside DeepSeek's exclusions, its tokenizer has "
                         f"{DEEPSEEK_LETTER_COUNT}")
    return "".join(f"\\x{{{a:X}}}" if a == b else f"\\x{{{a:X}}}-\\x{{{b:X}}}" for a, b in ranges)


def _deepseek_llm_splits() -> tuple[str, ...]:
    return (r"[\r\n]", rf"\s?[{_deepseek_letters()}]+", rf"\s?[{_DEEPSEEK_LLM_PUNCT}]+", r"\s+$",
            f"[{_DEEPSEEK_LLM_CJK}]+", r"\p{N}+")


_PRE_FAMILIES = {
    # GPT-2's own regex (built into the ByteLevel pre-tokenizer).
    "gpt2": ("default", "gpt2", "mpt", "olmo"),
    # Every digit alone first, then GPT-2's regex (SmolLM, StarCoder).
    "digits+gpt2": ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"),
    "llama3": ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "dbrx"),
    "qwen2": ("qwen2", "deepseek-r1-qwen", "megrez"),
    "o200k": ("gpt-4o", "llama4"),
    "deepseek3": ("deepseek-v3",),
    "deepseek-llm": ("deepseek-llm",),
}
GGUF_PRE_TOKENIZERS = {name: family for family, names in _PRE_FAMILIES.items() for name in names}


def gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    family = GGUF_PRE_TOKENIZERS.get(pre)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=family in ("gpt2", "digits+gpt2"))
    if family == "gpt2":
        return byte_level
    if family == "digits+gpt2":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if family in ("deepseek3", "deepseek-llm"):
        splits = _DEEPSEEK3_SPLITS if family == "deepseek3" else _deepseek_llm_splits()
        return pre_tokenizers.Sequence([*(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits),
                                        byte_level])
    if family in ("llama3", "qwen2", "o200k"):
        split = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "o200k": _O200K_SPLIT}[family]
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    raise ValueError(
        f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(sorted(GGUF_PRE_TOKENIZERS))}"
    )
