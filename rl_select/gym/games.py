"""VLM-Gym's games as G1 (arXiv 2505.13426, §3.1 and Appendix C; chenllliang/G1 ``vlmgym/sandbox/games``)
defines them, as pure functions over a JSON-serialisable state, so any number of environments step
together and N candidate actions are scored from one state without advancing it (GRPO groups).

Every game's step reward is G1's: +1 when the action does what the game rewards, −1 otherwise
(unparseable, illegal, or legal without the rewarded effect).

* **2048** — 4×4; actions the integers 0 Up, 1 Right, 2 Down, 3 Left (4, and anything else, is gymnasium-2048's
  "still": −1). +1 only when the move merges tiles; a shift without a merge moves the board (and a tile
  spawns) but scores −1; a move that changes nothing scores −1 and spawns nothing. A spawned tile is 2
  (p = 0.9) or 4. The episode score is the sum of the merged tiles' values.
* **Shisen-Sho** — 8×8; a tile is a (colour, shape) pair of 6 × 6, 16 kinds four times each. Action
  ``(r1, c1) (r2, c2)``; +1 iff both tiles have the same colour and shape and a path of at most two turns
  through empty cells (the ring outside the board counts as empty) joins them; the pair is removed.
* **Shisen-Sho CIFAR-10** — 6×6, 9 classes four times each, every tile a different image of its class; a pair
  matches when the classes are equal. CIFAR-10 cannot be fetched here: the images are ``render``'s
  procedurally drawn class pictures (a stand-in, four drawings per class), not CIFAR-10's photographs.
* **Swap** — match-3 on 8×8, tiles of 4 colours × 3 shapes. Action ``(r1, c1) (r2, c2)``: two orthogonally
  adjacent tiles swap; the swap stands only if it makes a line of three or more identical tiles, which then
  disappear, the tiles above fall and new tiles fall in (cascades repeat; a board with no valid swap is
  reshuffled). +1 when tiles disappear, −1 otherwise (the swap reverts). Score: ``len · (1 + len − 2)`` per
  removal wave of ``len`` tiles, as G1's ``gamematch3.py`` counts it.

Initial states are random walks from a fresh board: ``WALK_STEPS`` uniformly random actions of the game's
action space (G1: 100 for 2048, 250 for the others). Randomness inside a step (a 2048 spawn, a match-3
refill) is seeded by the board and action, so a state and an action always give the same next state, in
any process.
"""
from __future__ import annotations

import json
import re
from collections import deque

import numpy as np

GAMES = ("2048", "shisen-sho", "shisen-sho-cifar10", "swap")
WALK_STEPS = {"2048": 100, "shisen-sho": 250, "shisen-sho-cifar10": 250, "swap": 250}
SIZES = {"2048": 4, "shisen-sho": 8, "shisen-sho-cifar10": 6, "swap": 8}
ACTIONS_2048 = ("Up", "Right", "Down", "Left")
STILL = 4
SHISEN_COLORS = ("Red", "Green", "Blue", "Yellow", "Magenta", "Cyan")
SHISEN_SHAPES = ("circle", "square", "triangle", "diamond", "cross", "star")
SWAP_COLORS = ("Red", "Green", "Blue", "Yellow")
SWAP_SHAPES = ("circle", "square", "triangle")
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
_NUM = re.compile(r"<answer>.*?(\d+).*?</answer>", re.S)
_PAIR = re.compile(r"<answer>\s*\(\s*(\d+)\s*,\s*(\d+)\s*\)\s*,?\s*\(\s*(\d+)\s*,\s*(\d+)\s*\)\s*</answer>", re.S)


def _rng(*parts) -> np.random.Generator:
    import xxhash

    return np.random.default_rng(xxhash.xxh3_64(json.dumps(parts).encode()).intdigest())


# -- 2048 ---------------------------------------------------------------------------------------------------
def _slide_row(row: list[int]) -> tuple[list[int], int]:
    tiles, out, score, i = [x for x in row if x], [], 0, 0
    while i < len(tiles):
        if i + 1 < len(tiles) and tiles[i] == tiles[i + 1]:
            out.append(tiles[i] * 2)
            score += tiles[i] * 2
            i += 2
        else:
            out.append(tiles[i])
            i += 1
    return out + [0] * (len(row) - len(out)), score


def move_2048(board: list[list[int]], action: int) -> tuple[list[list[int]], int]:
    """(board after sliding, sum of the merged tiles' values); action 0 Up, 1 Right, 2 Down, 3 Left."""
    rot = {3: 0, 0: 1, 1: 2, 2: 3}[action]          # rotations that turn the move into a slide to the left
    r = np.rot90(np.array(board), rot)
    rows = [_slide_row([int(x) for x in row]) for row in r]
    return np.rot90(np.array([x for x, _ in rows]), -rot).tolist(), sum(s for _, s in rows)


def spawn_2048(board, rng) -> list[list[int]]:
    b = np.array(board)
    empty = np.argwhere(b == 0)
    if len(empty):
        r, c = empty[rng.integers(len(empty))]
        b[r, c] = 4 if rng.random() < 0.1 else 2
    return b.tolist()


# -- Shisen-Sho -------------------------------------------------------------------------------------------------
def shisen_connect(board: list[list[int]], a: tuple[int, int], b: tuple[int, int]) -> bool:
    """A path of ≤ 3 straight segments (≤ 2 turns) from a to b through empty cells (0) or the ring just outside
    the board; BFS over (cell, direction) keeping the fewest turns."""
    H, W = len(board), len(board[0])

    def free(r, c):
        if (r, c) == tuple(b):
            return True
        if r < 0 or c < 0 or r >= H or c >= W:
            return -1 <= r <= H and -1 <= c <= W
        return board[r][c] == 0

    dirs = ((1, 0), (-1, 0), (0, 1), (0, -1))
    best, q = {}, deque((a[0], a[1], d, 0) for d in range(4))
    while q:
        r, c, d, turns = q.popleft()
        nr, nc = r + dirs[d][0], c + dirs[d][1]
        if not free(nr, nc):
            continue
        if (nr, nc) == tuple(b):
            return True
        for nd in range(4):
            nt = turns + (nd != d)
            if nt > 2 or best.get((nr, nc, nd), 9) <= nt:
                continue
            best[(nr, nc, nd)] = nt
            (q.appendleft if nd == d else q.append)((nr, nc, nd, nt))
    return False


def tile_class(game: str, v: int) -> int:
    """What a Shisen-Sho pair must share: the (colour, shape) kind, or the CIFAR-10 class."""
    return (v - 1) % 10 if game == "shisen-sho-cifar10" else v


def shisen_legal(board, a, b, game: str = "shisen-sho") -> bool:
    H, W = len(board), len(board[0])
    if tuple(a) == tuple(b) or not all(0 <= x < H and 0 <= y < W for x, y in (a, b)):
        return False
    ka, kb = board[a[0]][a[1]], board[b[0]][b[1]]
    return ka != 0 and kb != 0 and tile_class(game, ka) == tile_class(game, kb) and shisen_connect(board, a, b)


def shisen_moves(board, game: str = "shisen-sho") -> list[tuple]:
    cells = [(r, c) for r, row in enumerate(board) for c, v in enumerate(row) if v]
    return [(a, b) for i, a in enumerate(cells) for b in cells[i + 1:] if shisen_legal(board, a, b, game)]


def _shisen_board(game: str, rng, size: int) -> list[list[int]]:
    n = size * size
    if game == "shisen-sho-cifar10":
        # a tile is 1 + class + 10·drawing: four different drawings of each of n/4 classes
        classes = rng.choice(10, size=n // 4, replace=n // 4 > 10)
        tiles = np.array([1 + c + 10 * k for c in classes for k in range(4)])
    else:
        kinds = rng.choice(len(SHISEN_COLORS) * len(SHISEN_SHAPES), size=n // 4, replace=False) + 1
        tiles = np.repeat(kinds, 4)
    tiles = np.concatenate([tiles, np.zeros(n - len(tiles), dtype=int)])
    rng.shuffle(tiles)
    return tiles.reshape(size, size).tolist()


# -- Swap (match-3) ---------------------------------------------------------------------------------------------
N_SWAP_KINDS = len(SWAP_COLORS) * len(SWAP_SHAPES)


def find_lines(board) -> set[tuple[int, int]]:
    """Cells in a horizontal or vertical run of three or more identical tiles."""
    H, W, out = len(board), len(board[0]), set()
    for r in range(H):
        for c in range(W):
            v = board[r][c]
            if not v:
                continue
            if c + 2 < W and board[r][c + 1] == v == board[r][c + 2]:
                k = c
                while k < W and board[r][k] == v:
                    out.add((r, k))
                    k += 1
            if r + 2 < H and board[r + 1][c] == v == board[r + 2][c]:
                k = r
                while k < H and board[k][c] == v:
                    out.add((k, c))
                    k += 1
    return out


def _swapped(board, a, b):
    nb = [row[:] for row in board]
    nb[a[0]][a[1]], nb[b[0]][b[1]] = nb[b[0]][b[1]], nb[a[0]][a[1]]
    return nb


def swap_valid(board, a, b) -> bool:
    H, W = len(board), len(board[0])
    if not all(0 <= x < H and 0 <= y < W for x, y in (a, b)) or abs(a[0] - b[0]) + abs(a[1] - b[1]) != 1:
        return False
    return bool(find_lines(_swapped(board, a, b)))


def swap_moves(board) -> list[tuple]:
    H, W = len(board), len(board[0])
    return [((r, c), (r + dr, c + dc)) for r in range(H) for c in range(W) for dr, dc in ((0, 1), (1, 0))
            if r + dr < H and c + dc < W and swap_valid(board, (r, c), (r + dr, c + dc))]


def _resolve(board, rng) -> tuple[list[list[int]], int]:
    """Remove lines, let tiles fall, refill from the top, repeat; then reshuffle until a valid swap exists."""
    H, W, score = len(board), len(board[0]), 0
    while True:
        lines = find_lines(board)
        if not lines:
            break
        score += len(lines) * (1 + len(lines) - 2)
        for col in range(W):
            kept = [board[r][col] for r in range(H) if (r, col) not in lines]
            fresh = [int(rng.integers(1, N_SWAP_KINDS + 1)) for _ in range(H - len(kept))]
            for r, v in enumerate(fresh + kept):
                board[r][col] = v
    for _ in range(100):
        if swap_moves(board):
            break
        flat = [v for row in board for v in row]
        rng.shuffle(flat)
        board = [flat[r * W:(r + 1) * W] for r in range(H)]
        if find_lines(board):               # G1's shuffle_board resolves the lines a shuffle made, unscored
            board = _resolve(board, rng)[0]
            break
    return board, score


def _swap_board(rng, size: int) -> list[list[int]]:
    board = [[0] * size for _ in range(size)]
    for r in range(size):
        for c in range(size):
            for _ in range(10):       # G1's create_board: up to ten draws to avoid a ready-made line
                board[r][c] = int(rng.integers(1, N_SWAP_KINDS + 1))
                if not ((r >= 2 and board[r - 1][c] == board[r - 2][c] == board[r][c])
                        or (c >= 2 and board[r][c - 1] == board[r][c - 2] == board[r][c])):
                    break
    return _resolve(board, rng)[0]


# -- common ------------------------------------------------------------------------------------------------------
def parse_action(game: str, response: str):
    """G1's parsers on the first ``<answer>``: 2048 its first integer; the others ``(r1, c1) (r2, c2)``."""
    if game == "2048":
        m = _NUM.search(response or "")
        return int(m.group(1)) if m else None
    m = _PAIR.search(response or "")
    return ((int(m.group(1)), int(m.group(2))), (int(m.group(3)), int(m.group(4)))) if m else None


def format_action(game: str, action) -> str:
    return str(action) if game == "2048" else f"({action[0][0]}, {action[0][1]}) ({action[1][0]}, {action[1][1]})"


def new_board(game: str, rng: np.random.Generator, size: int | None = None) -> dict:
    size = size or SIZES[game]
    if game == "2048":
        b = spawn_2048(spawn_2048([[0] * size for _ in range(size)], rng), rng)
    elif game.startswith("shisen"):
        b = _shisen_board(game, rng, size)
    elif game == "swap":
        b = _swap_board(rng, size)
    else:
        raise ValueError(f"unknown game {game!r}; games: {GAMES}")
    return {"game": game, "board": b, "score": 0}


def random_action(state: dict, rng: np.random.Generator):
    """A uniform draw from the game's action space (G1's ``step_random``): 0–4 for 2048 (4 = still), any two
    cells for the others — most of which are illegal, as in G1."""
    n = len(state["board"])
    if state["game"] == "2048":
        return int(rng.integers(0, 5))
    r = rng.integers(0, n, size=4)
    return (int(r[0]), int(r[1])), (int(r[2]), int(r[3]))


def reset(game: str, rng: np.random.Generator, size: int | None = None, walk_steps: int | None = None) -> dict:
    """An initial state: a fresh board, then a random walk of ``walk_steps`` (G1's 100 / 250) steps."""
    state = new_board(game, rng, size)
    for _ in range(WALK_STEPS[game] if walk_steps is None else walk_steps):
        state = step(state, random_action(state, rng))[0]
    return {**state, "score": 0}


def step(state: dict, action) -> tuple[dict, float]:
    """(next state, reward ±1). Pure: ``state`` is not modified. ``state['score']`` accumulates the game's
    own score (2048: merged values; Shisen-Sho: pairs removed; Swap: G1's match-3 points)."""
    g, b = state["game"], state["board"]
    if action is None:
        return state, -1.0
    if g == "2048":
        if action not in (0, 1, 2, 3):
            return state, -1.0
        nb, merged = move_2048(b, action)
        if nb == b:
            return state, -1.0
        nb = spawn_2048(nb, _rng(b, action))
        return {**state, "board": nb, "score": state.get("score", 0) + merged}, (1.0 if merged > 0 else -1.0)
    a, c = action
    if g.startswith("shisen"):
        if not shisen_legal(b, a, c, g):
            return state, -1.0
        nb = [row[:] for row in b]
        nb[a[0]][a[1]] = nb[c[0]][c[1]] = 0
        return {**state, "board": nb, "score": state.get("score", 0) + 1}, 1.0
    if not swap_valid(b, a, c):
        return state, -1.0                    # an illegal swap reverts: the state is unchanged
    nb, gained = _resolve(_swapped(b, a, c), _rng(b, a, c))
    return {**state, "board": nb, "score": state.get("score", 0) + gained}, 1.0


def legal_actions(state: dict) -> list:
    """The actions that earn +1 from this state."""
    g, b = state["game"], state["board"]
    if g == "2048":
        return [a for a in range(4) if move_2048(b, a)[1] > 0]
    if g.startswith("shisen"):
        return shisen_moves(b, g)
    return swap_moves(b)


def cell_text(game: str, v: int) -> str:
    if not v:
        return "-"
    if game == "2048":
        return str(v)
    if game == "shisen-sho-cifar10":
        return CIFAR10_CLASSES[(v - 1) % 10]
    if game == "swap":
        return f"{SWAP_COLORS[(v - 1) // len(SWAP_SHAPES)]} {SWAP_SHAPES[(v - 1) % len(SWAP_SHAPES)]}"
    return f"{SHISEN_COLORS[(v - 1) // len(SHISEN_SHAPES)]} {SHISEN_SHAPES[(v - 1) % len(SHISEN_SHAPES)]}"


def perception_text(state: dict) -> str:
    """The board as G1's ``state_to_text`` writes it: a row per line, cells `` x `` joined by ``|``, ``-`` empty."""
    return "\n".join("|".join(f" {cell_text(state['game'], v)} " for v in row) for row in state["board"])
