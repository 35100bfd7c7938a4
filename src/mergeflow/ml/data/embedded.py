"""Embedded synthetic task suite: a formula-driven pretraining corpus and eight downstream tasks.

Everything is generated with numpy (plus scikit-learn's bundled handwritten digits), deterministically
from a seed, as uint8 RGB images.  The design goal is a *merging* benchmark: fine-tuning must clearly beat
a linear probe on the pretrained features, and the task vectors of different tasks must interfere only
moderately, as with the 8-task vision benchmark (Cars, DTD, EuroSAT, GTSRB, MNIST, RESISC45, SUN397, SVHN).

Pretraining corpus (disjoint from every downstream task)
    Each image holds one filled geometric shape and one random pen-stroke "glyph" (32 fixed characters, each
    a random 3-stroke pen path on a 4x4 lattice, fixed independently of the seed) on a procedural background, all in
    random colours spanning the whole hue circle with a clear lightness contrast.  Label heads:
      shape       12  which geometric shape
      glyph       32  which random glyph
      background   6  background pattern (plain, gradient, stripes, checker, smooth noise, dots)
      position     9  3x3 cell holding the shape
      hue          8  hue bin of the shape's colour (keeps colour, hence domain, information in the features)

Downstream tasks: each lives in its own visual domain (palette and style), intended to make the tasks
"irrelevant" rather than "contradictory" to one another (seed 004), while the labels need features the
pretraining heads did not make linearly separable.  Measured caveat: with a small ViT trained from scratch
this separation of domains did NOT by itself keep task vectors from interfering (task arithmetic recovered 9% of
the probe-to-individual gap); fine-tuning with feature preservation on the pretraining corpus
(``finetune.preserve_features``) is what makes them add up (33% in the default run).
      digits          10  real handwritten digits (sklearn 8x8, upsampled, random affine); grey ink on black (~MNIST)
      house_numbers   10  stroke-font digit between two flanking digits; cream on blue enamel plates    (~SVHN)
      signs           12  road sign: board (round / triangle / diamond) x arrow direction (4); red rim,
                          white face, grey-green street                                                (~GTSRB)
      rotation        16  rotation (22.5 degree steps) of an asymmetric 'F' glyph; dark ink on teal paper
      orientation     18  orientation (10 degree steps) of a noisy grating of random frequency; magenta/lilac
      texture          8  texture family (stripes, grid, checks, dots, zigzag, waves, blotches, crosshatch),
                          random scale / rotation; earth tones                                         (~DTD)
      count            6  number of bright dots (1-6) among dim clutter; yellow on dark green
      position         9  3x3 cell of the one closed ring among 3-6 broken rings ('C' shapes); cyan on dark red
    Related pairs: digits <-> house_numbers (same labels, digit identity, like MNIST/SVHN); signs <-> rotation
    (both read the direction of a stroke figure); orientation <-> texture (oriented periodic patterns).
    The other pairs are unrelated: different palettes, different label semantics.
    Class counts are chosen so that a linear probe on the pretrained features stays well below fine-tuning.
"""

from __future__ import annotations

import numpy as np

from mergeflow.ml.data._drawing import (
    _FONT_SEGS,
    _GLYPHS,
    _background,
    _chunked,
    _grid,
    _hsv,
    _paint,
    _render_strokes,
    _rotate,
    _shape_dist,
    _smooth_noise,
    _soft,
    _to_uint8,
)

PRETRAIN_HEADS: dict[str, int] = {"shape": 12, "glyph": 32, "background": 6, "position": 9, "hue": 8}

TASKS: dict[str, int] = {
    "digits": 10,
    "house_numbers": 10,
    "signs": 12,
    "rotation": 16,
    "orientation": 18,
    "texture": 8,
    "count": 6,
    "position": 9,
}


def _pretrain_chunk(rng, n, size):
    yy, xx = _grid(size)
    shape, glyph = rng.integers(0, 12, n), rng.integers(0, 32, n)
    bg_kind, pos = rng.integers(0, 6, n), rng.integers(0, 9, n)
    # The glyph goes to a different random cell than the shape.
    gpos = (pos + rng.integers(1, 9, n)) % 9
    # Colours: background dark or light (two close shades), objects of the opposite lightness, any hue.
    dark_bg = rng.random(n) < 0.5
    bh = rng.random(n)
    bv = np.where(dark_bg, rng.uniform(0.05, 0.4, n), rng.uniform(0.65, 1.0, n))
    c1 = _hsv(bh, rng.uniform(0, 1, n), bv)
    c2 = _hsv(
        (bh + rng.uniform(-0.1, 0.1, n)) % 1,
        rng.uniform(0, 1, n),
        np.clip(bv + np.where(dark_bg, 1, -1) * rng.uniform(0.1, 0.25, n), 0, 1),
    )
    img = _background(rng, n, size, bg_kind, c1, c2)
    hue = rng.random(n)
    fv = np.where(dark_bg, rng.uniform(0.7, 1.0, n), rng.uniform(0.0, 0.35, n))
    fg = _hsv(hue, rng.uniform(0.5, 1.0, n), fv)
    # Shape: centred in its cell with jitter, random size and rotation.
    cell = 2 / 3
    cx = -1 + cell * (pos % 3 + 0.5) + rng.uniform(-0.08, 0.08, n)
    cy = -1 + cell * (pos // 3 + 0.5) + rng.uniform(-0.08, 0.08, n)
    x, y = _rotate(
        xx - cx[:, None, None].astype(np.float32),
        yy - cy[:, None, None].astype(np.float32),
        rng.uniform(0, 2 * np.pi, n).astype(np.float32),
    )
    r = rng.uniform(0.25, 0.38, n).astype(np.float32)
    img = _paint(img, _soft(_shape_dist(shape, x, y, r), size), fg)
    # Glyph: same colour, in its own cell, small rotation/scale jitter.
    gx = -1 + cell * (gpos % 3 + 0.5) + rng.uniform(-0.05, 0.05, n)
    gy = -1 + cell * (gpos // 3 + 0.5) + rng.uniform(-0.05, 0.05, n)
    sc = rng.uniform(0.25, 0.32, n).astype(np.float32)[:, None, None]
    x, y = _rotate(
        xx - gx[:, None, None].astype(np.float32),
        yy - gy[:, None, None].astype(np.float32),
        rng.uniform(-0.3, 0.3, n).astype(np.float32),
    )
    img = _paint(
        img, _render_strokes(_GLYPHS[glyph], x / sc, y / sc, 0.18 * np.ones(n, np.float32), size * float(sc.mean())), fg
    )
    img += rng.normal(0, 0.02, img.shape).astype(np.float32)
    return _to_uint8(img), shape, glyph, bg_kind, pos, (hue * 8).astype(np.int64) % 8


def make_pretraining_corpus(n_images: int, image_size: int, seed: int) -> dict[str, np.ndarray]:
    """Formula-driven pretraining images with one label per PRETRAIN_HEADS key."""
    rng = np.random.default_rng([seed, 0x5EED])
    imgs, *labels = _chunked(_pretrain_chunk, n_images, rng, image_size)
    out = {"images": imgs}
    for name, lab in zip(PRETRAIN_HEADS, labels):
        out[name] = lab.astype(np.int64)
    return out


# ----------------------------------------------------------------------------- downstream tasks


def _jitter_colour(rng, n, h, s, v, dh=0.03, ds=0.1, dv=0.1):
    """A domain colour with small per-image jitter."""
    return _hsv(
        (h + rng.uniform(-dh, dh, n)) % 1,
        np.clip(s + rng.uniform(-ds, ds, n), 0, 1),
        np.clip(v + rng.uniform(-dv, dv, n), 0, 1),
    )


def _flat(rng, n, size, colour):
    return np.broadcast_to(colour[:, None, None, :], (n, size, size, 3)).copy()


def _sklearn_digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.images / 16.0).astype(np.float32), d.target.astype(np.int64)


def _warp_small(src: np.ndarray, size: int, scale, ang, tx, ty) -> np.ndarray:
    """Bilinear inverse-affine warp of small images src (N, h, w) into (N, size, size), zero outside."""
    n, h, w = src.shape
    yy, xx = _grid(size)
    x, y = _rotate(xx - tx[:, None, None], yy - ty[:, None, None], ang)
    # object coordinates in [-1, 1] -> source pixel coordinates
    sx = (x / scale[:, None, None] + 1) / 2 * w - 0.5
    sy = (y / scale[:, None, None] + 1) / 2 * h - 0.5
    x0, y0 = np.floor(sx).astype(int), np.floor(sy).astype(int)
    fx, fy = sx - x0, sy - y0
    idx = np.arange(n)[:, None, None]

    def tap(yi, xi):
        ok = (yi >= 0) & (yi < h) & (xi >= 0) & (xi < w)
        return np.where(ok, src[idx, np.clip(yi, 0, h - 1), np.clip(xi, 0, w - 1)], 0)

    return (
        (1 - fy) * ((1 - fx) * tap(y0, x0) + fx * tap(y0, x0 + 1))
        + fy * ((1 - fx) * tap(y0 + 1, x0) + fx * tap(y0 + 1, x0 + 1))
    ).astype(np.float32)


def _digits(rng, n, size, pool_x, pool_y):
    """Real handwritten digits (sklearn), random affine; grey ink on black, like MNIST."""
    i = rng.integers(0, len(pool_x), n)
    f = lambda a, b: rng.uniform(a, b, n).astype(np.float32)
    m = _warp_small(pool_x[i], size, f(0.6, 0.85), f(-0.25, 0.25), f(-0.15, 0.15), f(-0.15, 0.15))
    ink = f(0.6, 1.0)[:, None, None]
    img = np.repeat((m * ink)[..., None], 3, -1) + rng.normal(0, 0.05, (n, size, size, 1)).astype(np.float32)
    return _to_uint8(img), pool_y[i]


def _house_numbers(rng, n, size):
    """Stroke-font digit, centred, with partial flanking digits; white/cream on blue plates (SVHN-like)."""
    yy, xx = _grid(size)
    label = rng.integers(0, 10, n)
    img = _flat(rng, n, size, _jitter_colour(rng, n, 0.61, 0.8, 0.55, dv=0.2))
    img = img * (0.8 + 0.4 * _smooth_noise(rng, n, size, 3))[..., None]  # uneven lighting
    ink = _jitter_colour(rng, n, 0.13, 0.15, 0.95, ds=0.15)
    h = rng.uniform(0.38, 0.55, n).astype(np.float32)  # half-height of the digit
    slant = rng.uniform(-0.25, 0.25, n).astype(np.float32)[:, None, None]
    width = rng.uniform(0.09, 0.16, n).astype(np.float32)
    gap = (h * rng.uniform(1.4, 1.8, n)).astype(np.float32)
    cx = rng.uniform(-0.1, 0.1, n).astype(np.float32)
    cy = rng.uniform(-0.1, 0.1, n).astype(np.float32)
    for off, lab in ((-1, rng.integers(0, 10, n)), (1, rng.integers(0, 10, n)), (0, label)):
        x = (xx - (cx + off * gap)[:, None, None]) / h[:, None, None]
        y = (yy - cy[:, None, None]) / h[:, None, None]
        img = _paint(img, _render_strokes(_FONT_SEGS[lab], x - slant * y, y, width / h, size * h.mean()), ink)
    img += rng.normal(0, 0.04, img.shape).astype(np.float32)
    return _to_uint8(img), label


def _arrow_segs(direction: np.ndarray) -> np.ndarray:
    """Arrow (shaft + two barbs) pointing right, rotated to one of 4 directions (N,) -> (N, 3, 4)."""
    base = np.array([(-0.6, 0, 0.6, 0), (0.6, 0, 0.15, -0.4), (0.6, 0, 0.15, 0.4)], np.float32)
    ang = direction * np.pi / 2
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    out = np.empty((len(direction), 3, 4), np.float32)
    for k in (0, 2):
        out[:, :, k] = c * base[None, :, k] - s * base[None, :, k + 1]
        out[:, :, k + 1] = s * base[None, :, k] + c * base[None, :, k + 1]
    return out


def _signs(rng, n, size):
    """Road sign: board (round / triangle / diamond) x arrow direction (4); red rim, white face, street grey."""
    yy, xx = _grid(size)
    board, direction = rng.integers(0, 3, n), rng.integers(0, 4, n)
    grey = _jitter_colour(rng, n, 0.3, 0.15, 0.45, dv=0.15)
    img = _paint(_flat(rng, n, size, grey), _smooth_noise(rng, n, size, 5) > 0.6, _jitter_colour(rng, n, 0.3, 0.3, 0.3))
    r = rng.uniform(0.75, 0.95, n).astype(np.float32)
    cx = rng.uniform(-0.1, 0.15, n).astype(np.float32)[:, None, None]
    cy = rng.uniform(-0.1, 0.1, n).astype(np.float32)[:, None, None]
    x, y = _rotate(xx - cx, yy - cy, rng.uniform(-0.15, 0.15, n).astype(np.float32))
    kind = np.array([0, 2, 10])[board]  # circle, triangle, diamond from the shape bank
    outer = _shape_dist(kind, x, -y, r)
    img = _paint(img, _soft(outer, size), _jitter_colour(rng, n, 0.0, 0.85, 0.8))
    img = _paint(img, _soft(_shape_dist(kind, x, -y, r * 0.72), size), _jitter_colour(rng, n, 0.1, 0.05, 0.95, ds=0.05))
    s = (r * np.where(board == 1, 0.36, 0.45)).astype(np.float32)[:, None, None]
    oy = np.where(board == 1, 0.18 * r, 0).astype(np.float32)[:, None, None]  # triangle centroid is lower
    img = _paint(
        img,
        _render_strokes(_arrow_segs(direction), x / s, (y - oy) / s, 0.07 / s[:, 0, 0], size * float(s.mean())),
        _jitter_colour(rng, n, 0.0, 0.0, 0.1, ds=0.0),
    )
    img = img * rng.uniform(0.7, 1.2, (n, 1, 1, 1)).astype(np.float32) + rng.normal(0, 0.04, img.shape).astype(
        np.float32
    )
    return _to_uint8(img), board * 4 + direction


_F_GLYPH = np.array([(-0.4, -1, -0.4, 1), (-0.4, -1, 0.5, -1), (-0.4, -0.1, 0.3, -0.1)], np.float32)


def _rotation(rng, n, size):
    """An 'F' glyph rotated by k * 22.5 degrees (+-6 jitter); label k (16).  Dark ink on teal paper."""
    yy, xx = _grid(size)
    k = rng.integers(0, 16, n)
    img = _flat(rng, n, size, _jitter_colour(rng, n, 0.48, 0.45, 0.75, dv=0.15))
    img = _paint(img, 0.3 * _smooth_noise(rng, n, size, 4), _jitter_colour(rng, n, 0.55, 0.5, 0.6))
    ang = (k * np.pi / 8 + rng.uniform(-0.1, 0.1, n)).astype(np.float32)
    s = rng.uniform(0.35, 0.6, n).astype(np.float32)[:, None, None]
    cx = rng.uniform(-0.25, 0.25, n).astype(np.float32)[:, None, None]
    cy = rng.uniform(-0.25, 0.25, n).astype(np.float32)[:, None, None]
    x, y = _rotate(xx - cx, yy - cy, ang)
    segs = np.broadcast_to(_F_GLYPH, (n, 3, 4))
    img = _paint(
        img,
        _render_strokes(segs, x / s, y / s, 0.2 * np.ones(n, np.float32), size * float(s.mean())),
        _jitter_colour(rng, n, 0.6, 0.4, 0.15),
    )
    img += rng.normal(0, 0.04, img.shape).astype(np.float32)
    return _to_uint8(img), k


def _orientation(rng, n, size):
    """Orientation of a grating (18 classes, 10 degree steps, +-2 jitter), noisy, magenta / lilac."""
    yy, xx = _grid(size)
    k = rng.integers(0, 18, n)
    ang = (k * np.pi / 18 + rng.uniform(-0.035, 0.035, n)).astype(np.float32)[:, None, None]
    freq = rng.uniform(2.0, 5.0, n).astype(np.float32)[:, None, None]
    phase = rng.uniform(0, 2 * np.pi, n).astype(np.float32)[:, None, None]
    wave = 0.5 + 0.5 * np.sin((np.cos(ang) * xx + np.sin(ang) * yy) * freq * np.pi + phase)
    wave = wave * rng.uniform(0.4, 1.0, (n, 1, 1)) + 0.4 * (_smooth_noise(rng, n, size, 6) - 0.5)
    img = _paint(
        _flat(rng, n, size, _jitter_colour(rng, n, 0.85, 0.6, 0.35)),
        np.clip(wave, 0, 1),
        _jitter_colour(rng, n, 0.78, 0.3, 0.9),
    )
    img += rng.normal(0, 0.06, img.shape).astype(np.float32)
    return _to_uint8(img), k


def _texture(rng, n, size):
    """Texture family (8, DTD-like), random scale / rotation / phase; earth tones."""
    yy, xx = _grid(size)
    k = rng.integers(0, 8, n)
    f = rng.uniform(1.6, 3.0, n).astype(np.float32)[:, None, None]
    x, y = _rotate(xx, yy, rng.uniform(0, np.pi, n).astype(np.float32))
    x, y = (x + rng.uniform(0, 1, (n, 1, 1))) * f, (y + rng.uniform(0, 1, (n, 1, 1))) * f
    fx, fy = x % 1 - 0.5, y % 1 - 0.5
    noise = _smooth_noise(rng, n, size, 8)
    pats = [
        abs(fx) < 0.2,  # 0 stripes
        (abs(fx) < 0.12) | (abs(fy) < 0.12),  # 1 grid
        (np.floor(x) + np.floor(y)) % 2 == 0,  # 2 checks
        np.hypot(fx, fy) < 0.28,  # 3 dots
        abs((x + abs((y % 1) - 0.5) * 1.5) % 1 - 0.5) < 0.18,  # 4 zigzag
        abs(((x + 0.25 * np.sin(y * 2 * np.pi)) % 1) - 0.5) < 0.18,  # 5 waves
        noise > 0.55,  # 6 blotches
        (abs(((x + y) % 1) - 0.5) < 0.12) | (abs(((x - y) % 1) - 0.5) < 0.12),  # 7 crosshatch
    ]
    m = np.empty((n, size, size), np.float32)
    for c, p in enumerate(pats):
        m[k == c] = p[k == c]
    m = m * rng.uniform(0.5, 1.0, (n, 1, 1)) + 0.3 * (_smooth_noise(rng, n, size, 5) - 0.5)
    img = _paint(
        _flat(rng, n, size, _jitter_colour(rng, n, 0.08, 0.6, 0.35)),
        np.clip(m, 0, 1),
        _jitter_colour(rng, n, 0.1, 0.35, 0.8),
    )
    img += rng.normal(0, 0.05, img.shape).astype(np.float32)
    return _to_uint8(img), k


def _disc_centres(rng, n, max_n, r_lo, r_hi):
    """Centres and radii of max_n discs per image on a jittered 4x4 grid (so they rarely overlap)."""
    slots = np.argsort(rng.random((n, 16)), 1)[:, :max_n]
    cx = -1 + 0.5 * (slots % 4 + 0.5) + rng.uniform(-0.1, 0.1, slots.shape)
    cy = -1 + 0.5 * (slots // 4 + 0.5) + rng.uniform(-0.1, 0.1, slots.shape)
    return cx.astype(np.float32), cy.astype(np.float32), rng.uniform(r_lo, r_hi, slots.shape).astype(np.float32)


def _discs_mask(size, cx, cy, r, active):
    """Union mask of the active discs (N, K) -> (N, H, W)."""
    yy, xx = _grid(size)
    d = np.hypot(xx[:, None] - cx[..., None, None], yy[:, None] - cy[..., None, None]) - r[..., None, None]
    return _soft(np.where(active[..., None, None], d, 9.0).min(1), size)


def _count(rng, n, size):
    """Number of bright dots (1-6) among dim clutter; yellow on dark green."""
    k = rng.integers(1, 7, n)
    img = _flat(rng, n, size, _jitter_colour(rng, n, 0.33, 0.7, 0.3))
    clutter = _smooth_noise(rng, n, size, 10)
    img = _paint(img, 0.35 * (clutter > 0.6), _jitter_colour(rng, n, 0.28, 0.6, 0.45))
    cx, cy, r = _disc_centres(rng, n, 6, 0.07, 0.14)
    m = _discs_mask(size, cx, cy, r, np.arange(6)[None] < k[:, None])
    img = _paint(img, m, _jitter_colour(rng, n, 0.14, 0.85, 0.95))
    img += rng.normal(0, 0.05, img.shape).astype(np.float32)
    return _to_uint8(img), k - 1


def _position(rng, n, size):
    """3x3 cell of the one closed ring among 3-6 broken rings ('C' shapes); cyan on dark red."""
    yy, xx = _grid(size)
    cell = rng.integers(0, 9, n)
    img = _flat(rng, n, size, _jitter_colour(rng, n, 0.99, 0.7, 0.35))
    img = img * (0.85 + 0.3 * _smooth_noise(rng, n, size, 3))[..., None]
    fg = _jitter_colour(rng, n, 0.5, 0.7, 0.85)
    # distractors: broken rings with a random gap direction, none in the target's cell
    cx, cy, _ = _disc_centres(rng, n, 6, 0.0, 0.0)
    disc_cell = np.clip(((cx + 1) * 1.5).astype(int), 0, 2) + 3 * np.clip(((cy + 1) * 1.5).astype(int), 0, 2)
    active = (np.arange(6)[None] < rng.integers(3, 7, n)[:, None]) & (disc_cell != cell[:, None])
    dx, dy = xx[:, None] - cx[..., None, None], yy[:, None] - cy[..., None, None]
    gap = rng.uniform(0, 2 * np.pi, cx.shape)[..., None, None]
    in_gap = np.cos(np.arctan2(dy, dx) - gap) > 0.75
    d = np.where(in_gap, 9.0, abs(np.hypot(dx, dy) - 0.11) - 0.035)
    img = _paint(img, _soft(np.where(active[..., None, None], d, 9.0).min(1), size), fg)
    tx = -1 + (cell % 3 + 0.5) * 2 / 3 + rng.uniform(-0.1, 0.1, n)
    ty = -1 + (cell // 3 + 0.5) * 2 / 3 + rng.uniform(-0.1, 0.1, n)
    rad = np.hypot(xx - tx[:, None, None], yy - ty[:, None, None])
    img = _paint(img, _soft(abs(rad - 0.11) - 0.035, size), fg)
    img += rng.normal(0, 0.05, img.shape).astype(np.float32)
    return _to_uint8(img), cell


_RENDERERS = {
    "house_numbers": _house_numbers,
    "signs": _signs,
    "rotation": _rotation,
    "orientation": _orientation,
    "texture": _texture,
    "count": _count,
    "position": _position,
}


def make_task(name: str, n_train: int, n_val: int, n_test: int, image_size: int, seed: int) -> dict[str, np.ndarray]:
    """Train/val/test splits of one task, each from its own random stream (and, for digits, its own images)."""
    if name not in TASKS:
        raise ValueError(f"unknown embedded task {name!r}; available tasks: {', '.join(TASKS)}")
    out = {}
    if name == "digits":
        # Split the 1797 real digits into disjoint pools first, then augment within each pool.
        x, y = _sklearn_digits()
        perm = np.random.default_rng([seed, 0xD161]).permutation(len(x))
        cut1, cut2 = int(0.6 * len(x)), int(0.72 * len(x))
        pools = {"train": perm[:cut1], "val": perm[cut1:cut2], "test": perm[cut2:]}
    for k, (split, n) in enumerate((("train", n_train), ("val", n_val), ("test", n_test))):
        rng = np.random.default_rng([seed, sorted(TASKS).index(name), k])
        if name == "digits":
            imgs, labels = _chunked(_digits, n, rng, image_size, x[pools[split]], y[pools[split]])
        else:
            imgs, labels = _chunked(_RENDERERS[name], n, rng, image_size)
        out[f"{split}_x"], out[f"{split}_y"] = imgs, labels.astype(np.int64)
    return out
