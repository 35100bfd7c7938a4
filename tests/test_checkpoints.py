"""Published CLIP checkpoints -> timm's CLIP image tower (mergeflow.ml.checkpoints): each route checked against the
library that made the checkpoint, on small random models, and the restricted unpickler against crafted pickles."""

from __future__ import annotations

import collections
import os
import pickle
import sys
import textwrap
import types
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import save_file

from mergeflow.ml import checkpoints
from mergeflow.ml.checkpoints import read_checkpoint, read_tensors, resolve_source
from mergeflow.core.errors import MergeflowError

# a small CLIP image tower: width 64, 2 layers of 2 heads, MLP 128, patch 32 at 224 px, embedding 32
WIDTH, DEPTH, HEADS, EMBED = 64, 2, 2, 32


def timm_clip(width=WIDTH, depth=DEPTH) -> torch.nn.Module:
    """The pipeline's backbone for CLIP: timm's OpenAI CLIP B/32 (pre-norm, LayerNorm eps 1e-5, QuickGELU), head =
    the visual projection, class-token pooling."""
    return timm.create_model(
        "vit_base_patch32_clip_quickgelu_224",
        embed_dim=width,
        depth=depth,
        num_heads=HEADS,
        mlp_ratio=2,
        num_classes=EMBED,
        global_pool="token",
    ).eval()


def embed(net: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.nn.functional.normalize(net(images), dim=-1)


def hf_clip(width=WIDTH, depth=DEPTH):
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(0)
    cfg = CLIPVisionConfig(
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=depth,
        num_attention_heads=HEADS,
        image_size=224,
        patch_size=32,
        projection_dim=EMBED,
        hidden_act="quick_gelu",
    )
    model = CLIPVisionModelWithProjection(cfg).eval()
    with torch.no_grad():  # random LayerNorm affines and biases too, so that every tensor's route is checked
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


@pytest.fixture
def images():
    return torch.randn(3, 3, 224, 224, generator=torch.Generator().manual_seed(1))


def test_hugging_face_clip_vision_model_with_projection(tmp_path, images):
    """A CLIPVisionModelWithProjection safetensors file (FusionBench's format) gives, in timm, HF's image_embeds."""
    hf = hf_clip()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "model.safetensors")
    net = timm_clip()
    net.load_state_dict(read_checkpoint(tmp_path / "model.safetensors", reference=net.state_dict()))
    with torch.no_grad():
        expected = torch.nn.functional.normalize(hf(pixel_values=images).image_embeds, dim=-1)
    torch.testing.assert_close(embed(net, images), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prefix", ["vision_model.", ""], ids=["transformers-4", "transformers-5"])
def test_hugging_face_clip_vision_model_takes_the_pretrained_projection(tmp_path, images, prefix):
    """A CLIPVisionModel file has no visual_projection: it is taken from projection_from, and without it the
    error says so in one line. FusionBench's files (transformers 4) name the tower 'vision_model.*',
    transformers 5's save_pretrained leaves the prefix out."""
    with_projection = hf_clip()
    tower = {
        k.removeprefix("vision_model."): v.contiguous()
        for k, v in with_projection.state_dict().items()
        if k.startswith("vision_model.")
    }
    save_file({prefix + k: v for k, v in tower.items()}, tmp_path / "model.safetensors")
    pretrained = read_checkpoint(dict(with_projection.state_dict()))  # the projection's source: a timm state
    net = timm_clip()
    with pytest.raises(MergeflowError, match=r"no visual projection.*projection_from") as err:
        read_checkpoint(tmp_path / "model.safetensors", reference=net.state_dict())
    assert "\n" not in str(err.value)
    net.load_state_dict(
        read_checkpoint(tmp_path / "model.safetensors", reference=net.state_dict(), projection_from=pretrained)
    )
    with torch.no_grad():
        expected = torch.nn.functional.normalize(with_projection(pixel_values=images).image_embeds, dim=-1)
    torch.testing.assert_close(embed(net, images), expected, atol=1e-5, rtol=1e-5)


# the task arithmetic repository's classes (github:mlfoundations/task_vectors, src/modeling.py), reduced to what
# a pickle records; importing the module appends a line to $MERGEFLOW_TEST_IMPORT_LOG
MODELING = """
import os
import torch

with open(os.environ["MERGEFLOW_TEST_IMPORT_LOG"], "a") as log:
    log.write("imported\\n")


class ImageEncoder(torch.nn.Module):
    def __init__(self, model, train_preprocess, val_preprocess):
        super().__init__()
        self.model, self.train_preprocess, self.val_preprocess = model, train_preprocess, val_preprocess
        delattr(self.model, "transformer")  # keep_lang=False, as the original does

    def forward(self, images):
        return self.model.encode_image(images)


class ClassificationHead(torch.nn.Linear):
    def __init__(self, normalize, weights, biases):
        super().__init__(weights.shape[1], weights.shape[0])
        self.normalize = normalize
        self.weight = torch.nn.Parameter(weights.clone())
        self.bias = torch.nn.Parameter(biases.clone())
"""


@pytest.fixture
def modeling(tmp_path, monkeypatch):
    """A throwaway ``src.modeling`` to pickle with; gone from sys.modules and sys.path (its files too) before any
    read, and its import log to prove no read imported it."""
    root = tmp_path / "task_vectors"
    (root / "src").mkdir(parents=True)
    (root / "src" / "__init__.py").write_text("")
    (root / "src" / "modeling.py").write_text(textwrap.dedent(MODELING))
    log = tmp_path / "imports.log"
    monkeypatch.setenv("MERGEFLOW_TEST_IMPORT_LOG", str(log))
    sys.path.insert(0, str(root))
    saved = {name: sys.modules.pop(name) for name in ("src", "src.modeling") if name in sys.modules}
    try:
        import src.modeling

        yield src.modeling
    finally:
        sys.path.remove(str(root))
        for name in ("src", "src.modeling"):
            sys.modules.pop(name, None)
        sys.modules.update(saved)
        for file in (root / "src").glob("*.py"):
            file.unlink()
    assert log.read_text() == "imported\n"  # once, to save: never again while reading


def forget(module) -> None:
    """Take the throwaway modeling module out of reach before reading."""
    root = str(Path(module.__file__).parents[1])
    sys.path.remove(root)
    for name in ("src", "src.modeling"):
        sys.modules.pop(name, None)
    Path(module.__file__).unlink()
    sys.path.insert(0, root)  # the fixture's teardown removes it again


def test_task_arithmetic_image_encoder(tmp_path, images, modeling):
    """A torch.save'd whole ImageEncoder (open_clip CLIP + torchvision transforms) is read by the restricted
    unpickler with state_dict()'s names and values, and gives in timm open_clip's encode_image."""
    import open_clip

    torch.manual_seed(0)
    clip = open_clip.model.CLIP(
        EMBED,
        dict(layers=DEPTH, width=WIDTH, head_width=WIDTH // HEADS, mlp_ratio=2, patch_size=32, image_size=224),
        dict(context_length=8, vocab_size=50, width=32, heads=2, layers=1),
        quick_gelu=True,
    ).eval()
    with torch.no_grad():
        for p in clip.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    encoder = modeling.ImageEncoder(
        clip, open_clip.image_transform(224, is_train=True), open_clip.image_transform(224, is_train=False)
    )
    expected_state = {k: v.clone() for k, v in encoder.state_dict().items()}
    with torch.no_grad():
        expected = torch.nn.functional.normalize(clip.encode_image(images), dim=-1)
    torch.save(encoder, tmp_path / "finetuned.pt")
    forget(modeling)

    raw = read_tensors(tmp_path / "finetuned.pt")
    assert list(raw) == list(expected_state)
    for key, value in expected_state.items():
        assert torch.equal(raw[key], value), key
    net = timm_clip()
    net.load_state_dict(read_checkpoint(tmp_path / "finetuned.pt", reference=net.state_dict()))
    torch.testing.assert_close(embed(net, images), expected, atol=1e-5, rtol=1e-5)


def test_classification_head(tmp_path, modeling):
    """head_<Dataset>.pt, a pickled ClassificationHead(nn.Linear): its weight and bias come back, from torch.save's
    zip and from a plain pickle (storages inline)."""
    weight, bias = torch.randn(10, EMBED), torch.randn(10)
    head = modeling.ClassificationHead(True, weight, bias)
    torch.save(head, tmp_path / "head_MNIST.pt")
    (tmp_path / "head_plain.pkl").write_bytes(pickle.dumps(head, protocol=2))
    forget(modeling)
    for name in ("head_MNIST.pt", "head_plain.pkl"):
        state = read_tensors(tmp_path / name)
        assert set(state) == {"weight", "bias"}
        assert torch.equal(state["weight"], weight) and torch.equal(state["bias"], bias)


class _Exploit:
    """Unpickling this runs ``call(*args)``."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


@pytest.mark.parametrize("attack", ["os.system", "builtins.exec"])
@pytest.mark.parametrize("container", ["torch-zip", "pickle"])
def test_crafted_pickle_runs_nothing(tmp_path, attack, container):
    """A pickle whose REDUCE calls os.system or exec is read without calling them: one line, no marker file."""
    import builtins

    marker = tmp_path / "pwned"
    exploit = (
        _Exploit(os.system, f"touch {marker}")
        if attack == "os.system"
        else _Exploit(builtins.exec, f"open({str(marker)!r}, 'w').close()")
    )
    path = tmp_path / "finetuned.pt"
    if container == "torch-zip":
        torch.save(exploit, path)
    else:
        path.write_bytes(pickle.dumps(exploit))
    with pytest.raises(MergeflowError, match=r"holds no tensors") as err:
        read_tensors(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)
    assert not marker.exists()
    # hidden inside an otherwise valid checkpoint: the tensors come back, the call is only recorded
    torch.save({"weight": torch.ones(2), "extra": exploit}, path)
    assert set(read_tensors(path)) == {"weight"}
    assert not marker.exists()


class _Reduce:
    """Pickles as ``__reduce__`` returning ``reduced``: (callable, args[, state for a BUILD])."""

    def __init__(self, *reduced):
        self.reduced = reduced

    def __reduce__(self):
        return self.reduced


def one_line_error(call, *match):
    with pytest.raises(MergeflowError, match=match[0] if match else None) as err:
        call()
    message = str(err.value)
    assert message.isascii() and message.isprintable(), repr(message)  # one line, no terminal escapes
    return message


@pytest.mark.parametrize("form", ["slot-state", "dict-state"])
@pytest.mark.parametrize(
    "target", ["torch._utils _rebuild_tensor_v2", "torch._utils _rebuild_parameter", "copyreg _reconstructor"]
)
def test_build_on_an_allowed_function_is_refused(tmp_path, target, form):
    """pickle's BUILD on a global the reader allows (``(None, {'__defaults__': ...})`` sets the function's
    attributes) is refused in one line, and the reader's function is the same for the next file."""
    module, name = target.split()
    func = checkpoints._ALLOWED[(module, name)]
    defaults, attributes = func.__defaults__, dict(vars(func))
    state = b"}V__defaults__\n\x88NN\x87s"  # {'__defaults__': (True, None, None)}
    path = tmp_path / "build.pkl"
    path.write_bytes(
        b"\x80\x02c"
        + f"{module}\n{name}\n".encode()
        + (b"N" + state + b"\x86" if form == "slot-state" else state)
        + b"b."
    )
    try:
        assert "BUILD" in one_line_error(lambda: read_tensors(path), str(path))
        assert func.__defaults__ == defaults and vars(func) == attributes
    finally:
        func.__defaults__ = defaults
        vars(func).clear()
        vars(func).update(attributes)


def strided(storage: torch.Tensor, offset, size, stride, state=None) -> _Reduce:
    """A tensor that torch.save pickles as this view of ``storage``'s elements (then a BUILD of ``state``)."""
    return _Reduce(
        torch._utils._rebuild_tensor_v2,
        (storage._typed_storage(), offset, size, stride, False, collections.OrderedDict()),
        state,
    )


def test_build_on_a_tensor_reference_is_refused(tmp_path):
    """A BUILD on a rebuilt tensor would set its size and stride past the rebuild's checks."""
    rebuilt = strided(torch.ones(4), 0, (4,), (1,), state=(None, {"size": (2**40,), "stride": (0,)}))
    torch.save({"weight": rebuilt}, tmp_path / "build.pt")
    one_line_error(lambda: read_tensors(tmp_path / "build.pt"), r"BUILD")


@pytest.mark.parametrize(
    ("offset", "size", "stride", "expected"),
    [
        (0, (2**40,), (0,), "larger than its storage of 3 elements"),  # stride 0: one element read, 4 TiB to copy
        (0, (2, 2), (1, 1), "larger than its storage of 3 elements"),  # every index within the storage, 4 elements of 3
        (1, (3,), (1,), "runs past its storage of 3 elements"),
        (0, (2, 3), (2**62, 1), "runs past its storage of 3 elements"),
    ],
)
def test_tensor_views_stay_within_their_storage(tmp_path, offset, size, stride, expected):
    """A tensor must reach only its storage's elements, and no more of them than it holds: else one line, before
    anything is allocated."""
    path = tmp_path / "view.pt"
    torch.save({"weight": strided(torch.arange(3.0), offset, size, stride)}, path)
    one_line_error(lambda: read_tensors(path), rf"{path.name}: not a checkpoint mergeflow reads: .*{expected}")
    torch.save({"weight": strided(torch.arange(4.0), 1, (2,), (2,))}, path)  # a view within it: copied out
    assert torch.equal(read_tensors(path)["weight"], torch.tensor([1.0, 3.0]))


def test_tensor_that_torch_cannot_build(tmp_path, monkeypatch):
    """torch refusing to build a tensor (an allocation that fails) is one line naming the file and the tensor."""
    path = tmp_path / "view.pt"
    torch.save({"weight": strided(torch.arange(4.0), 0, (2,), (2,))}, path)

    def fail(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes.\nError code 12")

    monkeypatch.setattr(torch.Tensor, "clone", fail)
    one_line_error(
        lambda: read_tensors(path),
        rf"{path.name}: .*tensor 'weight' could not be built \(RuntimeError: DefaultCPUAllocator",
    )


def test_untyped_storage(tmp_path):
    """dtypes without a storage type of their own (float8) are saved over torch.storage.UntypedStorage."""
    weight = torch.tensor([0.5, -2.0, 448.0]).to(torch.float8_e4m3fn)
    torch.save({"weight": weight}, tmp_path / "fp8.pt")
    state = read_tensors(tmp_path / "fp8.pt")
    assert state["weight"].dtype == torch.float8_e4m3fn and torch.equal(state["weight"].float(), weight.float())


def shared_chain(depth: int) -> list[torch.nn.Module]:
    """Modules 0..depth, each holding the next under two names: a tree of 2**depth paths to the last."""
    modules = [torch.nn.Module() for _ in range(depth + 1)]
    for parent, child in zip(modules, modules[1:]):
        parent.a = child
        parent.b = child
    return modules


def test_shared_submodules_are_listed_under_each_name(tmp_path):
    """A submodule registered under several names: its tensors under each, as module.state_dict() gives them."""
    modules = shared_chain(3)
    for i, module in enumerate(modules):
        module.weight = torch.nn.Parameter(torch.full((2,), float(i)))
    torch.save(modules[0], tmp_path / "shared.pt")
    state = read_tensors(tmp_path / "shared.pt")
    expected = modules[0].state_dict()
    assert list(state) == list(expected) and len(state) == 1 + 2 + 4 + 8
    assert all(torch.equal(state[k], v) for k, v in expected.items())


@pytest.mark.timeout(60, method="signal")
def test_shared_submodules_are_walked_once(tmp_path):
    """40 levels of submodules shared under two names (2**40 paths, no tensors below the root) read at once."""
    modules = shared_chain(40)
    modules[0].weight = torch.nn.Parameter(torch.ones(2))
    torch.save(modules[0], tmp_path / "shared.pt")
    assert set(read_tensors(tmp_path / "shared.pt")) == {"weight"}


@pytest.mark.timeout(60, method="signal")
def test_shared_submodules_naming_too_many_tensors(tmp_path):
    """The same with a tensor at the bottom: state_dict() would name it 2**40 times; refused in one line."""
    modules = shared_chain(40)
    modules[-1].weight = torch.nn.Parameter(torch.ones(2))
    torch.save(modules[0], tmp_path / "shared.pt")
    one_line_error(lambda: read_tensors(tmp_path / "shared.pt"), r"shared.pt: .*a module tree naming more than")


def test_names_in_errors_are_printable(tmp_path, monkeypatch):
    """Globals and attribute names the pickle chose (a newline, a terminal escape) are escaped in the one line."""
    module_name = "src.modeling\n\x1b[31mred"
    encoder = type("Encoder", (), {"__module__": module_name, "__qualname__": "Encoder\r\x1b[2K"})
    fake = types.ModuleType(module_name)
    setattr(fake, encoder.__qualname__, encoder)
    monkeypatch.setitem(sys.modules, module_name, fake)  # for pickle to find the class by its names
    (tmp_path / "root.pkl").write_bytes(pickle.dumps(encoder(), protocol=4))
    net = torch.nn.Module()
    net._parameters["weight\n\x1b[0m"] = encoder()
    (tmp_path / "module.pkl").write_bytes(pickle.dumps(net, protocol=4))
    monkeypatch.delitem(sys.modules, module_name)
    message = one_line_error(lambda: read_tensors(tmp_path / "root.pkl"), "holds no tensors")
    assert r"src.modeling\n\x1b[31mred.Encoder\r\x1b[2K" in message
    message = one_line_error(lambda: read_tensors(tmp_path / "module.pkl"), "not a tensor")
    assert r"'weight\n\x1b[0m' is Encoder\r\x1b[2K" in message


def test_not_a_checkpoint(tmp_path):
    path = tmp_path / "notes.pt"
    path.write_text("hello")
    with pytest.raises(MergeflowError, match=r"notes\.pt: not a checkpoint mergeflow reads: neither a torch.save zip"):
        read_tensors(path)


@pytest.mark.parametrize(
    ("width", "depth", "expected"),
    [
        (WIDTH, DEPTH + 1, r"unexpected tensor 'blocks\.2\.[\w.]+' absent from the pretrained backbone"),
        (96, DEPTH, r"tensor 'cls_token' has shape \(1, 1, 96\), expected \(1, 1, 64\)"),
    ],
)
def test_mismatched_checkpoint(tmp_path, width, depth, expected):
    """A fine-tune of another depth or width: one line naming the first differing tensor."""
    save_file(
        {k: v.contiguous() for k, v in hf_clip(width, depth).state_dict().items()}, tmp_path / "model.safetensors"
    )
    with pytest.raises(MergeflowError, match=expected) as err:
        read_checkpoint(tmp_path / "model.safetensors", reference=timm_clip().state_dict())
    assert "\n" not in str(err.value) and "model.safetensors" in str(err.value)


def test_resolve_source_offline(monkeypatch, tmp_path):
    """A hub repository not in the cache: one line saying to run with --download; a cached one: its
    model.safetensors, asked for with safetensors and JSON only."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    calls = []

    def missing(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        raise LocalEntryNotFoundError(
            "Cannot find an appropriate cached snapshot folder for the specified revision on the local disk"
        )

    monkeypatch.setattr(huggingface_hub, "snapshot_download", missing)
    with pytest.raises(
        MergeflowError,
        match=r"hf:tanganke/clip-vit-base-patch32_sun397: not in the local Hugging Face cache; run with --download",
    ) as err:
        resolve_source("hf:tanganke/clip-vit-base-patch32_sun397", download=False)
    assert "\n" not in str(err.value)
    assert calls == [
        (
            "tanganke/clip-vit-base-patch32_sun397",
            dict(revision=None, allow_patterns=["*.safetensors", "*.json"], local_files_only=True),
        )
    ]
    with pytest.raises(MergeflowError, match=r"could not download it") as err:
        resolve_source("hf:tanganke/clip-vit-base-patch32_sun397", download=True)
    assert "\n" not in str(err.value)

    (tmp_path / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kwargs: str(tmp_path))
    assert resolve_source("hf:tanganke/clip-vit-base-patch32_sun397", download=False) == tmp_path / "model.safetensors"
