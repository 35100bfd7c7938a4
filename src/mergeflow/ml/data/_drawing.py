"""The drawing primitives the embedded suite renders with, batched in numpy: colour, shapes as distance fields,
pen-stroke glyphs on a lattice, noise, rotation, backgrounds. Deterministic functions of their arguments and of
the generator they are given."""

from __future__ import annotations

import numpy as np

_CHUNK = 2048  # images rendered at once (bounds memory of the batched numpy code)


# ----------------------------------------------------------------------------- small helpers


def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel-centre coordinates in [-1, 1], shape (1, H, W) each (y down, x right)."""
    c = (np.arange(size, dtype=np.float32) + 0.5) / size * 2 - 1
    yy, xx = np.meshgrid(c, c, indexing="ij")
    return yy[None], xx[None]


def _hsv(h, s, v) -> np.ndarray:
    """Vectorised HSV -> RGB; h in [0, 1) (turns), s, v in [0, 1]; returns (..., 3) float32."""
    h, s, v = np.broadcast_arrays(np.asarray(h, np.float32), np.asarray(s, np.float32), np.asarray(v, np.float32))
    k = np.stack([(5 + h * 6) % 6, (3 + h * 6) % 6, (1 + h * 6) % 6], -1)
    f = np.clip(np.minimum(k, 4 - k), 0, 1)
    return (v[..., None] - v[..., None] * s[..., None] * f).astype(np.float32)


def _paint(img: np.ndarray, mask: np.ndarray, colour: np.ndarray) -> np.ndarray:
    """Alpha-blend per-image colour (N, 3) into img (N, H, W, 3) through mask (N, H, W) in [0, 1]."""
    m = mask[..., None]
    return img * (1 - m) + colour[:, None, None, :] * m


def _soft(d: np.ndarray, size: int) -> np.ndarray:
    """Anti-aliased mask from a signed distance (negative inside), distances in [-1, 1] units."""
    return np.clip(0.5 - d * size / 2, 0, 1)


def _smooth_noise(rng: np.random.Generator, n: int, size: int, cells: int) -> np.ndarray:
    """Low-frequency noise in [0, 1]: a random cells x cells grid, bilinearly upsampled to size."""
    g = rng.random((n, cells + 1, cells + 1), dtype=np.float32)
    t = np.linspace(0, cells, size, dtype=np.float32)
    i = np.minimum(t.astype(int), cells - 1)
    f = t - i
    rows = g[:, i] * (1 - f)[None, :, None] + g[:, i + 1] * f[None, :, None]
    return rows[:, :, i] * (1 - f)[None, None, :] + rows[:, :, i + 1] * f[None, None, :]


def _seg_dist(px: np.ndarray, py: np.ndarray, segs: np.ndarray) -> np.ndarray:
    """Distance from pixels (N, H, W) to the nearest of per-image segments (N, S, 4: x0, y0, x1, y1)."""
    x0, y0, x1, y1 = (segs[:, :, k][:, :, None, None] for k in range(4))
    dx, dy = x1 - x0, y1 - y0
    t = np.clip(((px[:, None] - x0) * dx + (py[:, None] - y0) * dy) / np.maximum(dx * dx + dy * dy, 1e-6), 0, 1)
    d = np.hypot(px[:, None] - (x0 + t * dx), py[:, None] - (y0 + t * dy))
    return d.min(1)


def _rotate(x: np.ndarray, y: np.ndarray, ang: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rotate coordinates (N, H, W) by per-image angles (N,) in radians (inverse mapping for rendering)."""
    c, s = np.cos(ang)[:, None, None], np.sin(ang)[:, None, None]
    return c * x + s * y, -s * x + c * y


def _to_uint8(img: np.ndarray) -> np.ndarray:
    return (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8)


def _chunked(fn, n: int, rng: np.random.Generator, *args):
    """Run a batched renderer fn(rng, n_chunk, *args) -> (images, labels...) over chunks and concatenate."""
    outs = [fn(rng, min(_CHUNK, n - i), *args) for i in range(0, n, _CHUNK)]
    return tuple(np.concatenate([o[k] for o in outs]) for k in range(len(outs[0])))


# ----------------------------------------------------------------------------- shapes and glyphs


def _shape_dist(kind: np.ndarray, x: np.ndarray, y: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Signed-ish distance (negative inside) of 12 shape kinds; x, y already centred/rotated (N, H, W)."""
    r = np.broadcast_to(r[:, None, None], x.shape)
    rad, th = np.hypot(x, y), np.arctan2(y, x)
    out = np.empty_like(x)
    for k in np.unique(kind):  # evaluate each formula only on the images of that kind
        sel = kind == k
        out[sel] = _SHAPES[k](x[sel], y[sel], r[sel], rad[sel], th[sel])
    return out


def _poly(n):
    """Regular n-gon with circumradius r."""
    a = 2 * np.pi / n
    return lambda x, y, r, rad, th: rad * np.cos((th % a) - a / 2) - r * np.cos(np.pi / n)


_SHAPES = [
    lambda x, y, r, rad, th: rad - r,  # 0 circle
    lambda x, y, r, rad, th: np.maximum(abs(x), abs(y)) - 0.8 * r,  # 1 square
    _poly(3),  # 2 triangle
    _poly(5),  # 3 pentagon
    _poly(6),  # 4 hexagon
    lambda x, y, r, rad, th: rad - r * (0.6 + 0.4 * np.cos(5 * th)),  # 5 five-petal flower
    lambda x, y, r, rad, th: np.minimum(
        np.maximum(abs(x) - 0.3 * r, abs(y) - r), np.maximum(abs(y) - 0.3 * r, abs(x) - r)
    ),  # 6 cross
    lambda x, y, r, rad, th: abs(rad - 0.75 * r) - 0.25 * r,  # 7 ring
    lambda x, y, r, rad, th: np.maximum(rad - r, -y),  # 8 half disc
    lambda x, y, r, rad, th: np.hypot(x, 2 * y) - r,  # 9 ellipse
    lambda x, y, r, rad, th: (abs(x) + abs(y)) / 1.2 - 0.8 * r,  # 10 diamond
    lambda x, y, r, rad, th: np.maximum(rad - r, 0.8 * r - np.hypot(x - 0.45 * r, y)),  # 11 crescent
]


def _glyph_bank(n_glyphs: int, n_strokes: int, seed: int) -> np.ndarray:
    """Fixed random pen-stroke characters: (n_glyphs, n_strokes, 4) segments on a 4x4 lattice in [-1, 1]."""
    rng = np.random.default_rng(seed)
    lattice = np.linspace(-1, 1, 4, dtype=np.float32)
    bank = np.zeros((n_glyphs, n_strokes, 4), np.float32)
    for g in range(n_glyphs):
        p = rng.integers(0, 4, 2)
        for s in range(n_strokes):  # a connected pen path: each stroke starts where the last ended
            q = p.copy()
            while (q == p).all():
                q = rng.integers(0, 4, 2)
            bank[g, s] = [lattice[p[0]], lattice[p[1]], lattice[q[0]], lattice[q[1]]]
            p = q if rng.random() < 0.75 else rng.integers(0, 4, 2)
    return bank


_GLYPHS = _glyph_bank(32, 3, seed=12345)  # fixed across corpus seeds: the label "glyph k" means one character

# Digits 0-9 of a simple stroke font (segments on a [-1, 1] box, width ~0.6 of height); used by house_numbers.
_FONT = {
    0: [(-0.5, -1, 0.5, -1), (0.5, -1, 0.5, 1), (0.5, 1, -0.5, 1), (-0.5, 1, -0.5, -1)],
    1: [(-0.2, -0.7, 0.1, -1), (0.1, -1, 0.1, 1), (-0.3, 1, 0.45, 1)],
    2: [(-0.5, -1, 0.5, -1), (0.5, -1, 0.5, 0), (0.5, 0, -0.5, 1), (-0.5, 1, 0.5, 1)],
    3: [(-0.5, -1, 0.5, -1), (0.5, -1, 0.5, 1), (-0.3, 0, 0.5, 0), (0.5, 1, -0.5, 1)],
    4: [(-0.5, -1, -0.5, 0.2), (-0.5, 0.2, 0.6, 0.2), (0.3, -0.6, 0.3, 1)],
    5: [(0.5, -1, -0.5, -1), (-0.5, -1, -0.5, 0), (-0.5, 0, 0.5, 0), (0.5, 0, 0.5, 1), (0.5, 1, -0.5, 1)],
    6: [(0.5, -1, -0.5, -1), (-0.5, -1, -0.5, 1), (-0.5, 1, 0.5, 1), (0.5, 1, 0.5, 0), (0.5, 0, -0.5, 0)],
    7: [(-0.5, -1, 0.5, -1), (0.5, -1, -0.1, 1)],
    8: [(-0.5, -1, 0.5, -1), (0.5, -1, 0.5, 1), (0.5, 1, -0.5, 1), (-0.5, 1, -0.5, -1), (-0.5, 0, 0.5, 0)],
    9: [(0.5, 0, -0.5, 0), (-0.5, 0, -0.5, -1), (-0.5, -1, 0.5, -1), (0.5, -1, 0.5, 1), (0.5, 1, -0.5, 1)],
}
_FONT_SEGS = np.zeros((10, 5, 4), np.float32)
for _d, _segs in _FONT.items():
    _FONT_SEGS[_d] = np.array(_segs + [_segs[-1]] * (5 - len(_segs)), np.float32)  # pad by repeating


def _render_strokes(segs: np.ndarray, x: np.ndarray, y: np.ndarray, half_width: np.ndarray, size: int):
    """Mask of per-image segment sets (N, S, 4) in object coordinates x, y (N, H, W)."""
    return _soft(_seg_dist(x, y, segs) - half_width[:, None, None], size)


# ----------------------------------------------------------------------------- pretraining corpus


def _background(rng, n, size, kind, c1, c2):
    """Six procedural background patterns mixing two colours (N, 3) each."""
    yy, xx = _grid(size)
    ang = rng.uniform(0, np.pi, n).astype(np.float32)[:, None, None]
    u = np.cos(ang) * xx + np.sin(ang) * yy
    freq = rng.uniform(2.5, 5.0, n).astype(np.float32)[:, None, None]
    pats = [
        np.zeros((n, size, size), np.float32),  # 0 plain
        (u + 1.4) / 2.8,  # 1 gradient
        (np.sin(u * freq * np.pi) > 0).astype(np.float32),  # 2 stripes
        ((np.floor((xx + 1) * freq) + np.floor((yy + 1) * freq)) % 2).astype(np.float32),  # 3 checker
        _smooth_noise(rng, n, size, 4),  # 4 smooth noise
        (np.hypot(((xx + 1) * freq) % 1 - 0.5, ((yy + 1) * freq) % 1 - 0.5) < 0.25).astype(np.float32),  # 5 dots
    ]
    m = np.empty((n, size, size), np.float32)
    for k, p in enumerate(pats):
        m[kind == k] = p[kind == k]
    img = np.broadcast_to(c1[:, None, None, :], (n, size, size, 3)).copy()
    return _paint(img, m, c2)
