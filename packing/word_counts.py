"""Exact token counts of many texts through a word cache: ``WordCounter(tok).count(texts)`` equals
``[len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]``, with one batched tokenizer
call per ``count`` for the words it has not seen before.

Why a cut is neutral. For byte-level BPE tokenizers with a GPT-2, Qwen2 or Llama-3 pre-tokenizer
regex (and no or NFC normalisation) a text can be cut before every space that follows a non-space
character: no pre-token of those regexes holds a non-space character followed by a space (a
pre-token that holds a space holds only whitespace before it), every character is matched, so the
scan restarts at the cut in the whole text as in the piece, and no lookahead reaches past a cut
(it follows a non-space character). NFC cannot join across it either: U+0020 is a starter that
composes with nothing. The pieces (≈ words: ``"Describe"``, ``" the"``, ``" image."``) are counted
from a cache, so a slice of a corpus tokenizes each distinct word once. With any other tokenizer
pipeline, each distinct text is one "word" (still exact, only slower).

Where. Texts whose every space follows a letter, number, punctuation, symbol or mark (RE2
``\\pL\\pN\\pP\\pS\\pM``, none of which is whitespace in any engine) are cut and deduplicated in Arrow
(``split_pattern``, ``dictionary_encode``); the rest in Python, only after characters every engine
calls non-space (word characters and ASCII punctuation: engines disagree on e.g. U+001C–U+001F).
The per-sample cost is then Arrow work plus one dict lookup per distinct word of a batch; a new
word costs one tokenizer call's share.
"""
from __future__ import annotations

import re

import numpy as np


class WordCounter:
    """Token ids and word-cached token counts of texts, for one tokenizer."""

    def __init__(self, tok):
        self.tok = tok
        self.backend = getattr(tok, "backend_tokenizer", None)
        self.cuttable = _cuttable(self.backend)
        self._first: dict[str, int] = {}    # a text's first word (or the whole text) → tokens
        self._rest: dict[str, int] = {}     # a later word w → tokens of " " + w

    def ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (no special tokens added), one batched call."""
        if not texts:
            return []
        if self.backend is not None:
            return [e.ids for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def lengths(self, texts: list[str]) -> list[int]:
        if self.backend is not None:
            return [len(e) for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]
        return [len(x) for x in self.ids(texts)]

    def count(self, texts: list[str]) -> np.ndarray:
        """Tokens of each text, exactly as ``len(tok(text)["input_ids"])``, for a whole batch.

        Where it is provably neutral (see ``_cut``) texts are cut into words — in Arrow, a text
        whose every space follows a letter, number, punctuation, symbol or mark; in Python
        (``_CUT``) the rest — and counted from a word cache; the words not seen before go to the
        tokenizer in one batched call. With another tokenizer pipeline each text is one "word"."""
        import pyarrow as pa
        import pyarrow.compute as pc

        n = len(texts)
        firsts, rests = [], []          # (owner rows, words) — Arrow arrays or Python lists
        arr = pa.array(texts, pa.string())
        if self.cuttable:
            slow = pc.match_substring_regex(arr, _UNSAFE_SPACE).to_numpy(zero_copy_only=False)
            fast = np.flatnonzero(~slow)
            parts = pc.split_pattern(arr.take(pa.array(fast)), " ")
            offs = parts.offsets.to_numpy()
            words = parts.flatten()
            is_rest = np.ones(len(words), bool)
            is_rest[offs[:-1]] = False
            owner = np.repeat(fast, np.diff(offs))
            firsts.append((fast, words.take(pa.array(offs[:-1]))))
            rests.append((owner[is_rest], words.filter(pa.array(is_rest))))
            slow = np.flatnonzero(slow).tolist()
        else:
            firsts.append((np.arange(n), arr))
            slow = []
        if slow:
            cuts = [_cut(texts[i]) for i in slow]
            firsts.append((np.array(slow, np.int64), pa.array([a for a, _ in cuts], pa.string())))
            rests.append((np.repeat(np.array(slow, np.int64), [len(b) for _, b in cuts]),
                          pa.array([w for _, b in cuts for w in b], pa.string())))
        out = np.zeros(n, np.int64)
        looked = [(rows, *self._lookup(words, self._first)) for rows, words in firsts]
        looked += [(rows, *self._lookup(words, self._rest)) for rows, words in rests]
        miss_f = sorted({w for rows, uniq, vals, idx in looked[:len(firsts)] for w, v in zip(uniq, vals) if v is None})
        miss_r = sorted({w for rows, uniq, vals, idx in looked[len(firsts):] for w, v in zip(uniq, vals) if v is None})
        if miss_f or miss_r:
            if len(self._first) + len(self._rest) > 4_000_000:  # bound memory on huge slices; counts stay exact
                self._first.clear()
                self._rest.clear()
            got_f, got_r = self._new_words(miss_f, miss_r)
            self._first.update(zip(miss_f, got_f))
            self._rest.update(zip(miss_r, got_r))
        for k, (rows, uniq, vals, idx) in enumerate(looked):
            cache = self._first if k < len(firsts) else self._rest
            vals = np.array([cache[w] if v is None else v for w, v in zip(uniq, vals)], np.int64)
            if len(idx):
                out += np.bincount(rows, weights=vals[idx], minlength=n).astype(np.int64)
        return out

    def _new_words(self, first: list[str], rest: list[str]) -> tuple[list[int], list[int]]:
        """Tokens of new first words (as they are) and new later words (``" " + w``), one batched
        call. Later words that end in a word or punctuation character are joined back into texts
        of up to 512 words — the joins are cuts of the kind ``_cut`` makes, so they change no
        token — and each token goes to the word its offset starts in (a word's tokens never leave
        it): one long text costs the tokenizer less per word than a text per word (~6 vs ~10 µs)."""
        if not (self.cuttable and rest):
            got = self.lengths(first + [" " + w for w in rest])
            return got[:len(first)], got[len(first):]
        joinable = [i for i, w in enumerate(rest) if _ENDS_CUTTABLE.search(w)]
        single = sorted(set(range(len(rest))).difference(joinable))
        groups = [joinable[i:i + 512] for i in range(0, len(joinable), 512)]
        texts = first + [" " + rest[i] for i in single] + ["".join(" " + rest[i] for i in g) for g in groups]
        encs = self.backend.encode_batch(texts, add_special_tokens=False)
        got_r = [0] * len(rest)
        for i, e in zip(single, encs[len(first):]):
            got_r[i] = len(e)
        for g, e in zip(groups, encs[len(first) + len(single):]):
            starts = np.cumsum([0] + [len(rest[i]) + 1 for i in g[:-1]])
            tok_starts = np.fromiter((o[0] for o in e.offsets), np.int64, count=len(e))
            per_word = np.bincount(np.searchsorted(starts, tok_starts, side="right") - 1, minlength=len(g))
            if per_word.sum() != len(e) or len(per_word) != len(g):
                raise RuntimeError("token offsets fell outside the joined words — tokenizer pipeline not as expected")
            for i, c in zip(g, per_word.tolist()):
                got_r[i] = c
        return [len(e) for e in encs[:len(first)]], got_r

    @staticmethod
    def _lookup(words, cache: dict):
        """``(distinct words, their cached counts or None, each word's index into them)``."""
        import pyarrow.compute as pc

        enc = pc.dictionary_encode(words)
        uniq = enc.dictionary.to_pylist()
        return uniq, list(map(cache.get, uniq)), enc.indices.to_numpy(zero_copy_only=False)


# Pre-tokenizer regexes under which a pre-token holding a space holds only whitespace before it,
# and every character is matched: so the regex never joins a non-space character with the space
# after it, and cutting a text before such a space changes no token (the scan restarts there in
# both cases; a lookahead never reaches past a cut, which always follows a non-space character).
# NFC cannot join across it either: U+0020 is a starter that composes with nothing.
_GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_QWEN2 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
_LLAMA3 = _QWEN2.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
# A space after anything but a letter, number, punctuation, symbol or mark (none of which is
# whitespace in any engine): such a text is cut in Python, only after _CUT's characters.
_UNSAFE_SPACE = r"[^\pL\pN\pP\pS\pM] "
# In Python, cut only after word characters (letters, digits, _) and ASCII punctuation: \S for
# every regex engine (engines disagree on some exotic characters, e.g. U+001C-U+001F).
_CUT = re.compile(r"(?<=[\w!-/:-@\[-`{-~])(?= )")
_ENDS_CUTTABLE = re.compile(r"[\w!-/:-@\[-`{-~]\Z")


def _cut(s: str) -> tuple:
    """``(first word, [later words without their leading space])``. ASCII text without a space
    after whitespace (or after U+001C-U+001F) is cut before every space — one ``str.split``."""
    if s.isascii() and not ("  " in s or "\n " in s or "\t " in s or "\r " in s or "\x0b " in s or "\x0c " in s
                            or "\x1c " in s or "\x1d " in s or "\x1e " in s or "\x1f " in s):
        parts = s.split(" ")
        return parts[0], parts[1:]
    parts = _CUT.split(s)
    return parts[0], [p[1:] for p in parts[1:]]


def _cuttable(backend) -> bool:
    """Whether the tokenizer's pipeline is one where ``_cut`` is provably neutral: byte-level
    BPE, a GPT-2 / Qwen2 / Llama-3 pre-tokenizer regex, no or NFC normalisation."""
    if backend is None:
        return False
    import json

    try:
        spec = json.loads(backend.to_str())
    except Exception:
        return False
    norm, pre, model = spec.get("normalizer"), spec.get("pre_tokenizer") or {}, spec.get("model") or {}
    if model.get("type") != "BPE" or (norm is not None and norm.get("type") != "NFC"):
        return False
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return True
    subs = pre.get("pretokenizers") or []
    return (pre.get("type") == "Sequence" and len(subs) == 2 and subs[0].get("type") == "Split"
            and subs[0].get("behavior") == "Isolated" and not subs[0].get("invert")
            and (subs[0].get("pattern") or {}).get("Regex") in (_GPT2, _QWEN2, _LLAMA3)
            and subs[1].get("type") == "ByteLevel" and not subs[1].get("use_regex", True))
