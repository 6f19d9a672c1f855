"""VLM-Gym games (after the G1 paper): 2048, Shisen-Sho (letters or procedurally drawn picture
tiles) and Swap. Every game is a set of pure functions over a JSON-serialisable state, so any
number of environments step together and N candidate actions can be scored from the same
state without advancing it (GRPO groups).

Rewards follow the paper: +1 for an action that is legal and makes progress, −1 otherwise
(unparseable, illegal, or no progress).

* **2048** — 4×4 (``size``) board; actions ``up/down/left/right``; +1 iff the move changes the board.
* **Shisen-Sho** — H×W board of tile pairs (``kinds`` kinds); action ``(r1,c1),(r2,c2)``; +1 iff
  the two tiles match and connect by a path of ≤ 3 straight segments through empty cells (the
  ring just outside the board counts as empty).
* **Swap** — a permutation of 1…H·W on a grid; action ``(r1,c1),(r2,c2)`` swaps two adjacent
  cells; +1 iff the swap puts at least one tile in its home cell.
"""
from __future__ import annotations

import json
import re
from collections import deque

import numpy as np

ACTIONS_2048 = ("up", "down", "left", "right")
_PAIR = re.compile(r"\(\s*(\d+)\s*,\s*(\d+)\s*\)\s*,?\s*\(\s*(\d+)\s*,\s*(\d+)\s*\)")


# -- 2048 --------------------------------------------------------------------------------
def _slide_row(row: list[int]) -> list[int]:
    tiles = [x for x in row if x]
    out, i = [], 0
    while i < len(tiles):
        if i + 1 < len(tiles) and tiles[i] == tiles[i + 1]:
            out.append(tiles[i] * 2)
            i += 2
        else:
            out.append(tiles[i])
            i += 1
    return out + [0] * (len(row) - len(out))


def move_2048(board: list[list[int]], action: str) -> list[list[int]]:
    b = np.array(board)
    rot = {"left": 0, "up": 1, "right": 2, "down": 3}[action]
    r = np.rot90(b, rot)
    r = np.array([_slide_row(list(row)) for row in r])
    return np.rot90(r, -rot).tolist()


def spawn_2048(board, rng) -> list[list[int]]:
    b = np.array(board)
    empty = np.argwhere(b == 0)
    if len(empty):
        r, c = empty[rng.integers(len(empty))]
        b[r, c] = 4 if rng.random() < 0.1 else 2
    return b.tolist()


# -- Shisen-Sho ------------------------------------------------------------------------------
def shisen_connect(board: list[list[int]], a: tuple[int, int], b: tuple[int, int]) -> bool:
    """≤ 3 straight segments through empty cells (0) or the outer ring; BFS over (cell, dir) with turns."""
    H, W = len(board), len(board[0])

    def free(r, c):
        if (r, c) == b:
            return True
        if r < 0 or c < 0 or r >= H or c >= W:
            return -1 <= r <= H and -1 <= c <= W
        return board[r][c] == 0

    best = {}
    q = deque()
    for d, (dr, dc) in enumerate(((1, 0), (-1, 0), (0, 1), (0, -1))):
        q.append((a[0], a[1], d, 0))
    while q:
        r, c, d, turns = q.popleft()
        dr, dc = ((1, 0), (-1, 0), (0, 1), (0, -1))[d]
        nr, nc = r + dr, c + dc
        if not free(nr, nc):
            continue
        if (nr, nc) == b:
            return True
        for nd in range(4):
            nt = turns + (nd != d)
            if nt > 2 or best.get((nr, nc, nd), 9) <= nt:
                continue
            best[(nr, nc, nd)] = nt
            (q.appendleft if nd == d else q.append)((nr, nc, nd, nt))
    return False


def shisen_legal(board, a, b) -> bool:
    H, W = len(board), len(board[0])
    if a == b or not all(0 <= x < H and 0 <= y < W for x, y in (a, b)):
        return False
    ka, kb = board[a[0]][a[1]], board[b[0]][b[1]]
    return ka != 0 and ka == kb and shisen_connect(board, a, b)


def shisen_moves(board) -> list[tuple]:
    cells = [(r, c) for r, row in enumerate(board) for c, v in enumerate(row) if v]
    return [(a, b) for i, a in enumerate(cells) for b in cells[i + 1:] if shisen_legal(board, a, b)]


# -- Swap --------------------------------------------------------------------------------------
def swap_progress(board, a, b) -> bool:
    H, W = len(board), len(board[0])
    if not all(0 <= x < H and 0 <= y < W for x, y in (a, b)) or abs(a[0] - b[0]) + abs(a[1] - b[1]) != 1:
        return False
    home = lambda v: divmod(v - 1, W)  # noqa: E731
    va, vb = board[a[0]][a[1]], board[b[0]][b[1]]
    return home(va) == tuple(b) or home(vb) == tuple(a)


# -- common ------------------------------------------------------------------------------------
def parse_pair(text: str):
    m = _PAIR.search(text or "")
    return ((int(m.group(1)), int(m.group(2))), (int(m.group(3)), int(m.group(4)))) if m else None


def parse_action(game: str, text: str):
    if game == "2048":
        words = re.findall(r"[a-z]+", (text or "").lower())
        return next((w for w in reversed(words) if w in ACTIONS_2048), None)
    return parse_pair(text)


def reset(game: str, rng: np.random.Generator, size: int = 4, kinds: int = 6) -> dict:
    if game == "2048":
        b = [[0] * size for _ in range(size)]
        b = spawn_2048(spawn_2048(b, rng), rng)
        for _ in range(int(rng.integers(0, 40))):  # random play to a varied mid-game state
            legal = [a for a in ACTIONS_2048 if move_2048(b, a) != b]
            if not legal:
                break
            b = spawn_2048(move_2048(b, legal[int(rng.integers(len(legal)))]), rng)
        return {"game": game, "board": b}
    if game.startswith("shisen"):
        H, W = size, size + 2
        n = H * W
        tiles = np.repeat(np.arange(1, kinds + 1), -(-n // kinds) + 1)[:n]
        if len(tiles) % 2:
            tiles[-1] = 0
        rng.shuffle(tiles)
        # make counts even per kind so every tile has a partner
        board = tiles.reshape(H, W).tolist()
        counts = {}
        for row in board:
            for v in row:
                counts[v] = counts.get(v, 0) + 1
        for k, c in counts.items():
            if k and c % 2:
                r, col = next((r, c2) for r, row in enumerate(board) for c2, v in enumerate(row) if v == k)
                board[r][col] = 0
        return {"game": game, "board": board}
    if game == "swap":
        perm = rng.permutation(size * size) + 1
        return {"game": game, "board": perm.reshape(size, size).tolist()}
    raise ValueError(f"unknown game {game!r}; games: 2048, shisen-sho, shisen-sho-pictures, swap")


def step(state: dict, action) -> tuple[dict, float]:
    """(next state, reward ±1). Pure: ``state`` is not modified."""
    g, b = state["game"], state["board"]
    if action is None:
        return state, -1.0
    if g == "2048":
        nb = move_2048(b, action)
        if nb == b:
            return state, -1.0
        import xxhash  # the spawned tile depends only on the board: deterministic across processes

        rng = np.random.default_rng(xxhash.xxh3_64(json.dumps(nb).encode()).intdigest())
        return {**state, "board": spawn_2048(nb, rng)}, 1.0
    a, c = action
    if g.startswith("shisen"):
        if not shisen_legal(b, a, c):
            return state, -1.0
        nb = [row[:] for row in b]
        nb[a[0]][a[1]] = nb[c[0]][c[1]] = 0
        return {**state, "board": nb}, 1.0
    if not swap_progress(b, a, c):
        return state, -1.0
    nb = [row[:] for row in b]
    nb[a[0]][a[1]], nb[c[0]][c[1]] = nb[c[0]][c[1]], nb[a[0]][a[1]]
    return {**state, "board": nb}, 1.0


def legal_actions(state: dict) -> list:
    g, b = state["game"], state["board"]
    if g == "2048":
        return [a for a in ACTIONS_2048 if move_2048(b, a) != b]
    if g.startswith("shisen"):
        return shisen_moves(b)
    H, W = len(b), len(b[0])
    out = []
    for r in range(H):
        for c in range(W):
            for dr, dc in ((0, 1), (1, 0)):
                if r + dr < H and c + dc < W and swap_progress(b, (r, c), (r + dr, c + dc)):
                    out.append(((r, c), (r + dr, c + dc)))
    return out


def perception_text(state: dict) -> str:
    """The board as the model should read it off the image (perception ground truth)."""
    return "\n".join(" ".join(str(v) for v in row) for row in state["board"])
