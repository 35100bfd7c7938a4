"""One image, decoded and resized as every source of the suite resizes it (``suite.resize``)."""

from __future__ import annotations

import numpy as np

from mergeflow.core.errors import MergeflowError


def resize_image(image, size: int, mode: str = "squash") -> np.ndarray:
    """One image (PIL or array, grayscale or palette too) as uint8 [size, size, 3]. ``squash``: the whole image to
    size x size (bilinear; the aspect is lost). ``crop``: CLIP's eval transform, the short side to ``size``
    (bicubic), then the centre size x size (torchvision's Resize(size, BICUBIC) + CenterCrop(size), by hand).
    Only the result is kept: the intermediate images are closed (the caller closes ``image``)."""
    from PIL import Image

    rgb = (image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image))).convert("RGB")
    try:
        if mode == "squash":
            out = rgb.resize((size, size), Image.BILINEAR)
        elif mode == "crop":
            w, h = rgb.size
            short, long = (w, h) if w <= h else (h, w)
            new_long = int(size * long / short)  # torchvision's rounding, towards zero
            new_w, new_h = (size, new_long) if w <= h else (new_long, size)
            resized = rgb.resize((new_w, new_h), Image.BICUBIC)
            top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
            out = resized.crop((left, top, left + size, top + size))
            resized.close()
        else:
            raise MergeflowError(f"suite.resize: '{mode}' is not one of squash, crop")
        try:
            return np.asarray(out, dtype=np.uint8)
        finally:
            out.close()
    finally:
        rgb.close()
