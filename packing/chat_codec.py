"""How ``packing.tokens`` counts a whole slice of conversations with one batched tokenizer call.

Shapes. The chat template is rendered once per conversation *shape* — the role sequence plus the
image/text piece layout of each turn — with sentinel texts, and split at the tokenizer's added
tokens (``<|im_start|>``, ``<|image_pad|>``, …; the tokenizer splits there too, so the regions
between them tokenize independently). Regions without a sentinel are fixed (tokenized once per
shape); a region holding a sentinel is a variable segment (e.g. ``"assistant\\n" + text``). A
sample's count is its shape's fixed count plus the tokens of its filled-in segments; the loss
mask is the assistant segments minus their role header, plus the end-of-turn token after each.
Each shape is checked once against a full render of probe texts (token for token), and a template
that does not insert turn texts verbatim (strips, rewrites or repeats them) is rejected.

Words: segment texts are counted by ``packing.word_counts.WordCounter`` (a word cache; the
words never seen go to the tokenizer in one batched call per batch of samples).
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from manifests.conversation import IMAGE_TOKEN, check_conversation, split_images, to_messages
from packing.image_tokens import IMAGE_PAD, VISION_END, VISION_START, ImageTokenConfig, image_pad_tokens
from packing.word_counts import WordCounter

# End-of-turn tokens that close an assistant turn and are trained on (the model must learn to stop).
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def turn_pairs(roles: Sequence[str]) -> list[int]:
    """End (exclusive) of each turn pair: a pair is the turns up to and including an assistant
    turn (its user turn(s), and a leading system turn for the first pair). ``truncate`` keeps a
    prefix of whole pairs, so a conversation of pairs ``[2, 4, 7]`` can become 2, 4 or 7 turns."""
    return [i + 1 for i, r in enumerate(roles) if r == "assistant"]


# ---------------------------------------------------------------------------------------------
# Conversations as flat arrays (what Arrow hands us without building a dict per turn).

@dataclass
class Conversations:
    """A batch of conversations: turn ``t`` of sample ``j`` is ``roles[t], texts[t]`` for
    ``turn_lo[j] <= t < turn_hi[j]``; its images are ``heights/widths[image_lo[j]:image_hi[j]]``."""

    roles: list
    texts: list
    turn_lo: np.ndarray
    turn_hi: np.ndarray
    heights: np.ndarray
    widths: np.ndarray
    image_lo: np.ndarray
    image_hi: np.ndarray
    _layouts: tuple | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.turn_lo)

    @classmethod
    def from_lists(cls, turns: Sequence[Sequence[tuple[str, str]]],
                   image_sizes: Sequence[Sequence[tuple[int, int]]]) -> "Conversations":
        """``turns[j]``: ``(role, text)`` pairs; ``image_sizes[j]``: ``(height, width)`` per image."""
        nt = np.array([len(t) for t in turns], np.int64)
        ni = np.array([len(s) for s in image_sizes], np.int64)
        hw = np.array([x for s in image_sizes for x in s], np.int64).reshape(-1, 2)
        return cls([r for t in turns for r, _ in t], [x for t in turns for _, x in t],
                   np.cumsum(nt) - nt, np.cumsum(nt), hw[:, 0].copy(), hw[:, 1].copy(),
                   np.cumsum(ni) - ni, np.cumsum(ni))

    @classmethod
    def from_arrow(cls, conversation, images) -> "Conversations":
        """From the ``samples`` columns ``conversation`` (list<struct<role, text>>) and ``images``
        (list<IMAGE_ADDRESS>); null lists are empty, null texts are ``""``."""
        import pyarrow as pa
        import pyarrow.compute as pc

        def bounds(col):
            col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
            n = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False).astype(np.int64)
            return col.flatten(), np.cumsum(n) - n, np.cumsum(n)

        turns, tlo, thi = bounds(conversation)
        imgs, ilo, ihi = bounds(images)
        texts = pc.fill_null(turns.field("text"), "").to_pylist()
        h = pc.fill_null(imgs.field("height"), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        w = pc.fill_null(imgs.field("width"), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        return cls(turns.field("role").to_pylist(), texts, tlo, thi, h, w, ilo, ihi)

    def layouts(self):
        """Per turn (computed once): its layout (``"IT"``: an image, then text; ``""``: empty); the
        text pieces of the turns that hold images; and the running count of those turns, so a
        sample's shape key and holes are mostly slices."""
        if self._layouts is None:
            texts = self.texts
            lays = ["T" if t else "" for t in texts]
            pieces, seen = {}, {}     # image-bearing turns repeat a few prompts ("<image>", templates)
            for i in [i for i, t in enumerate(texts) if IMAGE_TOKEN in t]:
                hit = seen.get(texts[i])
                if hit is None:
                    ps = split_images(texts[i])
                    hit = seen[texts[i]] = ("".join(["I" if p == IMAGE_TOKEN else "T" for p in ps]),
                                            [p for p in ps if p != IMAGE_TOKEN])
                lays[i], pieces[i] = hit          # the pieces list is shared: read only
            run = np.zeros(len(texts) + 1, np.int64)
            if pieces:
                run[np.fromiter(pieces, np.int64, count=len(pieces)) + 1] = 1
            self._layouts = (lays, pieces, np.cumsum(run))
        return self._layouts


@dataclass
class TokenCounts:
    """Per sample: tokens in training (``total = text + image``), loss tokens, and — when the
    conversation cannot be rendered — a status/error (``None`` when fine; counts are 0 then)."""

    total: np.ndarray
    text: np.ndarray
    image: np.ndarray
    target: np.ndarray
    status: list
    error: list


# ---------------------------------------------------------------------------------------------
# Shapes: the template rendered once per (role, piece layout) sequence.

_SENT = "\ue000{}\ue001"                        # private-use code points: never in real text
_SENT_RE = re.compile("\ue000(\\d+)\ue001")
# Padded with whitespace when rendered, so a template that strips turn texts is caught.
_PAD_L, _PAD_R = "\n \t", " \n"


@dataclass
class _Segment:
    parts: tuple               # strings and hole numbers (ints), concatenated in order
    target: bool               # holds an assistant turn's text
    head: int = 0              # tokens of the fixed text before the hole (role header), not trained on
    tail: int = 0              # tokens of the fixed text after it


@dataclass
class _Shape:
    n_images: int
    n_holes: int
    status: tuple | None = None                     # (status, error) when the shape is not trainable
    pieces: list = field(default_factory=list)      # ("ids", ids, mask) | ("img",) | ("seg", k)
    segments: list = field(default_factory=list)
    n_fixed: int = 0           # fixed tokens, image pads not included
    n_markers: int = 0         # vision start/end tokens among them (counted as image tokens)
    n_fixed_target: int = 0    # end-of-turn tokens trained on
    id: int = -1               # index in ChatCodec.shapes_by_id
    fill: list | None = None   # (prefix, hole, suffix) per segment when every segment holds one hole
    prefixes: tuple | None = None  # ... and when those are holes 0, 1, 2, … with no suffix: the prefixes


_add = operator.add
_CAPTION_KEY = (("user", "assistant"), ("IT", "T"))
_IMAGE_PAIR = (("user", "assistant"), ("I", "T"))      # user "<image>" exactly, assistant text


def with_caption_prompt(key: tuple, holes: list, caption_prompt: str, n_images: int) -> tuple[tuple, list]:
    """The caption-pair rule, on a shape: a conversation shaped ``[user "<image>", assistant text]``
    over one image trains as ``"<image>" + caption_prompt`` → text; any other shape is unchanged."""
    if key == _IMAGE_PAIR and caption_prompt and n_images == 1:
        return _CAPTION_KEY, [caption_prompt, holes[0]]
    return key, holes


def shape_key(roles: Sequence[str], texts: Sequence[str], caption_prompt: str = "", n_images: int = -1):
    """``(key, holes)``: the conversation's shape — ``(roles, layouts)``, a layout per turn such as
    ``"IT"`` (an image, then text) — and its text pieces in order (``with_caption_prompt`` applied)."""
    lays, holes = [], []
    for text in texts:
        if IMAGE_TOKEN in text:
            ps = split_images(text)
            lays.append("".join("I" if p == IMAGE_TOKEN else "T" for p in ps))
            holes += [p for p in ps if p != IMAGE_TOKEN]
        else:
            lays.append("T" if text else "")
            if text:
                holes.append(text)
    return with_caption_prompt((tuple(roles), tuple(lays)), holes, caption_prompt, n_images)


class ChatCodec:
    """Shape plans and the batched text counter of one tokenizer (``codec_for(tok)``)."""

    def __init__(self, tok):
        self.tok = tok
        self.shapes: dict[tuple, _Shape] = {}
        self.shapes_by_id: list[_Shape] = []
        added = dict(getattr(tok, "added_tokens_encoder", {}) or tok.get_added_vocab())
        for t, spec in getattr(tok, "added_tokens_decoder", {}).items():
            if getattr(spec, "lstrip", False) or getattr(spec, "rstrip", False) or getattr(spec, "single_word", False):
                raise ValueError(f"added token {spec.content!r} strips neighbouring text (lstrip/rstrip/single_word): "
                                 f"texts between added tokens would not tokenize independently")
        if IMAGE_PAD not in added:
            raise ValueError(f"the tokenizer has no {IMAGE_PAD} token (a Qwen2-VL-style tokenizer is needed)")
        self.added = added
        self.added_re = re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
        self.pad_id = added[IMAGE_PAD]
        self.marker_ids = {added[t] for t in (VISION_START, VISION_END) if t in added}
        eot = set(END_OF_TURN) | ({tok.eos_token} if getattr(tok, "eos_token", None) else set())
        self.eot_ids = {added[t] for t in eot if t in added}
        self.words = WordCounter(tok)

    def ids(self, texts: list[str]) -> list[list[int]]:
        return self.words.ids(texts)

    def count_texts(self, texts: list[str]) -> np.ndarray:
        return self.words.count(texts)

    # -- shapes --------------------------------------------------------------------------------
    def shape(self, key: tuple) -> _Shape:
        s = self.shapes.get(key)
        if s is None:
            s = self._build_shape(key)
            s.id = len(self.shapes_by_id)
            self.shapes_by_id.append(s)
            self.shapes[key] = s
        return s

    def _build_shape(self, key: tuple) -> _Shape:
        roles, layouts = key
        turns, hole_roles = [], []
        for role, lay in zip(roles, layouts):
            text = ""
            for c in lay:
                if c == "I":
                    text += IMAGE_TOKEN
                else:
                    text += _SENT.format(len(hole_roles))
                    hole_roles.append(role)
            turns.append((role, text))
        n_images = sum(lay.count("I") for lay in layouts)
        shape = _Shape(n_images, len(hole_roles))
        bad = check_conversation(turns, n_images)
        if bad is not None:
            shape.status = bad
            return shape
        padded = self._render([(r, _SENT_RE.sub(lambda m: _PAD_L + m.group(0) + _PAD_R, t)) for r, t in turns])
        for k in range(len(hole_roles)):
            if padded.count(_PAD_L + _SENT.format(k) + _PAD_R) != 1:
                raise ValueError(f"the chat template does not insert turn text {k} verbatim (it strips, rewrites or "
                                 f"repeats it); exact token counts need a template that copies turn texts as given")
        rendered = self._render(turns)
        holes = [int(k) for k in _SENT_RE.findall(rendered)]
        if holes != list(range(len(hole_roles))):
            raise ValueError(f"the chat template reorders turn texts: {holes}")
        fixed_ids, fixed_mask = [], []

        def flush():
            if fixed_ids:
                shape.pieces.append(("ids", np.array(fixed_ids, np.int32), np.array(fixed_mask, np.uint8)))
                fixed_ids.clear()
                fixed_mask.clear()

        after_target = False
        for i, region in enumerate(self.added_re.split(rendered)):
            if i % 2:  # an added token
                tid = self.added[region]
                if tid == self.pad_id:
                    flush()
                    shape.pieces.append(("img",))
                else:
                    fixed_ids.append(tid)
                    fixed_mask.append(1 if after_target and tid in self.eot_ids else 0)
                after_target = False
                continue
            if not region:
                continue
            parts = [int(p) if j % 2 else p for j, p in enumerate(_SENT_RE.split(region))]
            if len(parts) == 1:
                fixed_ids.extend(self.ids([region])[0])
                fixed_mask.extend([0] * (len(fixed_ids) - len(fixed_mask)))
                after_target = False
                continue
            targets = [hole_roles[p] == "assistant" for p in parts[1::2]]
            if any(targets) and len(targets) > 1:
                raise ValueError("the chat template joins an assistant text with another turn's text without a special "
                                 "token between them; the loss mask cannot be placed")
            seg = _Segment(tuple(p for p in parts if p != ""), targets[0])
            if seg.target:
                seg.head, seg.tail = (len(x) for x in self.ids([parts[0], parts[-1]]))
            flush()
            shape.pieces.append(("seg", len(shape.segments)))
            shape.segments.append(seg)
            after_target = seg.target
        flush()
        if sum(p[0] == "img" for p in shape.pieces) != n_images:
            raise ValueError(f"the chat template must render one {IMAGE_PAD} per image part")
        ids_pieces = [p for p in shape.pieces if p[0] == "ids"]
        shape.n_fixed = sum(len(p[1]) for p in ids_pieces)
        shape.n_markers = sum(int(np.isin(p[1], list(self.marker_ids)).sum()) for p in ids_pieces)
        shape.n_fixed_target = sum(int(p[2].sum()) for p in ids_pieces)
        if all(sum(isinstance(p, int) for p in g.parts) == 1 for g in shape.segments):
            shape.fill = []
            for g in shape.segments:
                k = next(i for i, p in enumerate(g.parts) if isinstance(p, int))
                shape.fill.append(("".join(g.parts[:k]), g.parts[k], "".join(g.parts[k + 1:])))
            if all(post == "" and h == i for i, (_, h, post) in enumerate(shape.fill)):
                shape.prefixes = tuple(pre for pre, _, _ in shape.fill)
        self._check_shape(shape, turns)
        return shape

    def _render(self, turns) -> str:
        return self.tok.apply_chat_template(to_messages(turns), tokenize=False)

    def _check_shape(self, shape: _Shape, turns) -> None:
        """Once per shape: the pieces reproduce a full render of probe texts token for token."""
        probe = ["  Probe, text 1\n", "probe-text 2.", "\nthird  probe"]
        holes = [probe[k % 3] for k in range(shape.n_holes)]
        real = [(r, _SENT_RE.sub(lambda m: holes[int(m.group(1))], t)) for r, t in turns]
        want = self.tok(self._render(real), add_special_tokens=False)["input_ids"]
        got, _ = self.assemble(shape, holes, [1] * shape.n_images)
        segs = self.fill(shape, holes)
        if got.tolist() != list(want) or self.count_texts(segs).tolist() != [len(x) for x in self.ids(segs)]:
            raise ValueError("the chat template's pieces do not reproduce its full render for this conversation "
                             f"shape {[r for r, _ in turns]} — token counts would not be exact")

    def fill(self, shape: _Shape, holes: Sequence[str]) -> list[str]:
        return ["".join(p if isinstance(p, str) else holes[p] for p in seg.parts) for seg in shape.segments]

    def assemble(self, shape: _Shape, holes: Sequence[str], pads: Sequence[int]):
        """``(ids, mask)`` of one conversation of ``shape`` with its text pieces and pad counts."""
        seg_ids = self.ids(self.fill(shape, holes))
        out_ids, out_mask, img = [], [], 0
        for p in shape.pieces:
            if p[0] == "ids":
                out_ids.append(p[1])
                out_mask.append(p[2])
            elif p[0] == "img":
                out_ids.append(np.full(int(pads[img]), self.pad_id, np.int32))
                out_mask.append(np.zeros(int(pads[img]), np.uint8))
                img += 1
            else:
                seg, ids = shape.segments[p[1]], np.asarray(seg_ids[p[1]], np.int32)
                m = np.zeros(len(ids), np.uint8)
                if seg.target:
                    m[seg.head:len(ids) - seg.tail] = 1
                out_ids.append(ids)
                out_mask.append(m)
        if not out_ids:
            return np.zeros(0, np.int32), np.zeros(0, np.uint8)
        return np.concatenate(out_ids).astype(np.int32), np.concatenate(out_mask).astype(np.uint8)

    # -- batched counting ----------------------------------------------------------------------
    def count(self, convs: Conversations, img_cfg: ImageTokenConfig, caption_prompt: str = "",
              turn_hi: np.ndarray | None = None, image_hi: np.ndarray | None = None,
              rows: np.ndarray | None = None) -> TokenCounts:
        """Token counts of ``convs`` (or of ``rows`` of it, cut to ``turn_hi``/``image_hi``).

        The only work per sample is finding its shape and filling its segment strings; the
        strings of all samples go to ``count_texts`` at once and the sums are numpy over shape
        tables."""
        rows = np.arange(len(convs)) if rows is None else np.asarray(rows)
        t_lo, i_lo = convs.turn_lo[rows], convs.image_lo[rows]
        t_hi = convs.turn_hi[rows] if turn_hi is None else np.asarray(turn_hi)
        i_hi = convs.image_hi[rows] if image_hi is None else np.asarray(image_hi)
        n = len(rows)
        roles, shapes, shape_of = convs.roles, self.shapes, self.shape
        texts = convs.texts
        lays, pieces, run = convs.layouts()
        status, error = [None] * n, [None] * n
        strings, sids = [], []
        add, extend = strings.append, strings.extend
        for j, (a, b, na, ni) in enumerate(zip(t_lo.tolist(), t_hi.tolist(), (i_hi - i_lo).tolist(),
                                               (run[t_hi] - run[t_lo]).tolist())):
            key = (tuple(roles[a:b]), tuple(lays[a:b]))
            if ni:  # some turns hold images: their text pieces
                holes = []
                for t in range(a, b):
                    p = pieces.get(t)
                    if p is not None:
                        holes += p
                    elif texts[t]:
                        holes.append(texts[t])
            else:
                holes = [x for x in texts[a:b] if x]
            key, holes = with_caption_prompt(key, holes, caption_prompt, na)
            sh = shapes.get(key) or shape_of(key)
            if sh.status is not None or sh.n_images != na:
                status[j], error[j] = sh.status or ("image_mismatch", f"{sh.n_images} {IMAGE_TOKEN} placeholder(s) "
                                                                       f"but {na} image(s)")
                sids.append(-1)
                continue
            sids.append(sh.id)
            if sh.prefixes is not None:
                extend(map(_add, sh.prefixes, holes))
            elif sh.fill is not None:
                for pre, h, post in sh.fill:
                    add(pre + holes[h] + post)
            else:
                strings.extend(self.fill(sh, holes))
        counts = self.count_texts(strings) if strings else np.zeros(0, np.int64)
        # per-shape tables, indexed by shape id (one extra row for "bad": no segments, no tokens)
        table = self.shapes_by_id
        n_seg = np.array([len(x.segments) for x in table] + [0], np.int64)
        fixed = np.array([[x.n_fixed, x.n_markers, x.n_fixed_target] for x in table] + [[0, 0, 0]], np.int64)
        seg_base = np.cumsum(n_seg) - n_seg
        seg_tgt = np.array([g.target for x in table for g in x.segments], bool)
        seg_adj = np.array([g.head + g.tail for x in table for g in x.segments], np.int64)
        sid = np.array(sids, np.int64)
        sid[sid < 0] = len(table)
        per = n_seg[sid]
        seg_row = np.repeat(np.arange(n), per)
        g = seg_base[sid][seg_row] + np.arange(len(seg_row)) - np.repeat(np.cumsum(per) - per, per)
        tgt = seg_tgt[g] if len(g) else np.zeros(0, bool)
        var = np.bincount(seg_row, weights=counts, minlength=n).astype(np.int64)
        var_t = np.bincount(seg_row[tgt], weights=np.maximum(counts[tgt] - seg_adj[g][tgt], 0),
                            minlength=n).astype(np.int64)
        # image pads of every image in range, summed per row
        n_img = (i_hi - i_lo).astype(np.int64)
        owner = np.repeat(np.arange(n), n_img)
        idx = np.arange(len(owner)) - np.repeat(np.cumsum(n_img) - n_img, n_img) + np.repeat(i_lo.astype(np.int64), n_img)
        pads = image_pad_tokens(convs.heights[idx], convs.widths[idx], img_cfg) if len(idx) else np.zeros(0, np.int64)
        pads_sum = np.bincount(owner, weights=pads, minlength=n).astype(np.int64)
        bad = sid == len(table)
        f = fixed[sid]
        total = np.where(bad, 0, f[:, 0] + var + pads_sum)
        image = np.where(bad, 0, pads_sum + f[:, 1])
        target = np.where(bad, 0, f[:, 2] + var_t)
        return TokenCounts(total, total - image, image, target, status, error)

    def fit(self, convs: Conversations, rows: np.ndarray, max_tokens: int, img_cfg: ImageTokenConfig,
            caption_prompt: str = "") -> np.ndarray:
        """For each of ``rows`` (longer than ``max_tokens``): how many leading turns to keep — the
        most whole turn pairs whose exact length fits, 0 if not even the first pair fits. A binary
        search over the pair count, all rows advancing together (one batched count per round)."""
        rows = np.asarray(rows, np.int64)
        ends = [turn_pairs(convs.roles[convs.turn_lo[j]:convs.turn_hi[j]]) for j in rows.tolist()]
        lo = np.zeros(len(rows), np.int64)                      # pairs known to fit (0: none)
        hi = np.array([len(e) for e in ends], np.int64)          # pairs known not to fit
        while True:
            live = np.flatnonzero(hi - lo > 1)
            if not len(live):
                break
            mid = (lo[live] + hi[live]) // 2
            t_hi, i_hi = [], []
            for k, g in zip(live.tolist(), mid.tolist()):
                j = int(rows[k])
                a = int(convs.turn_lo[j])
                t_hi.append(a + ends[k][g - 1])
                i_hi.append(int(convs.image_lo[j]) + sum(t.count(IMAGE_TOKEN) for t in convs.texts[a:t_hi[-1]]))
            c = self.count(convs, img_cfg, caption_prompt, np.array(t_hi, np.int64), np.array(i_hi, np.int64), rows[live])
            ok = np.array([s is None for s in c.status]) & (c.total <= max_tokens)
            lo[live[ok]] = mid[ok]
            hi[live[~ok]] = mid[~ok]
        return np.array([e[g - 1] if g else 0 for e, g in zip(ends, lo.tolist())], np.int64)


_CODECS: dict[int, tuple[object, ChatCodec]] = {}


def codec_for(tok) -> ChatCodec:
    """The (cached) codec of a tokenizer: shapes and the word cache live as long as it."""
    hit = _CODECS.get(id(tok))
    if hit is None or hit[0] is not tok:
        if len(_CODECS) >= 8:
            _CODECS.clear()
        hit = _CODECS[id(tok)] = (tok, ChatCodec(tok))
    return hit[1]
