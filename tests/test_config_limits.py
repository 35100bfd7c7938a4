"""params.yaml mistakes that used to be a traceback, silent, or run until killed: each is one line naming the key
the user wrote, exit status 2, nothing written. Bytes that are not UTF-8, a key written twice, a name listed
twice, counts and sizes beyond any machine's, NaN and infinity, a study's settings that are not a mapping; and a
loss that becomes NaN names the learning rate or weight decay."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import yaml

from mergeflow.params import apply_overrides, load_params, parse_params
from mergeflow.core.errors import MergeflowError


@pytest.fixture
def raw(repo_root):
    return yaml.safe_load((repo_root / "params.yaml").read_text())


def _refused(raw, source="params.yaml") -> str:
    with pytest.raises(MergeflowError) as err:
        parse_params(raw, source)
    assert "\n" not in str(err.value)
    return str(err.value)


def _cli(args, cwd):
    proc = subprocess.run(
        [sys.executable, "-m", "mergeflow.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    return proc.returncode, proc.stderr.strip().splitlines()


# ---------------------------------------------------------------- bytes that are not UTF-8
def _where(data: bytes, bad: bytes) -> tuple[int, int]:
    """1-based line and column of ``bad`` in ``data`` (a column counts characters)."""
    at = data.index(bad)
    line_start = data.rfind(b"\n", 0, at) + 1
    return data.count(b"\n", 0, at) + 1, len(data[line_start:at].decode()) + 1


@pytest.mark.parametrize(
    "old, new, key",
    [
        (b"  - signs\n", b"  - sign\xe9s\n", "suite.tasks.2"),  # in a value
        (b"  lr: 0.0003\n", b"  lr: 0.0003   # caf\xe9 au lait\n", "finetune.lr"),  # in a comment after it
        (b"seed: 0\n", b"seed: 0 # \xff\n", "seed"),
    ],
)
def test_bytes_that_are_not_utf8_name_the_key_and_place(tmp_path, repo_root, old, new, key):
    data = (repo_root / "params.yaml").read_bytes().replace(old, new)
    (tmp_path / "params.yaml").write_bytes(data)
    bad = next(bytes([b]) for b in new if b >= 0x80)
    line, column = _where(data, bad)
    with pytest.raises(MergeflowError) as err:
        load_params(tmp_path / "params.yaml")
    assert (
        str(err.value) == f"{tmp_path / 'params.yaml'}: key '{key}', line {line}, column "
        f"{column}: byte 0x{bad[0]:02x} is not UTF-8 (save the file as UTF-8)"
    )


def test_bytes_that_are_not_utf8_through_the_cli_write_nothing(tmp_path, repo_root):
    data = (repo_root / "params.yaml").read_bytes().replace(b"  batch_size: 64\n", b"  batch_size: 64\xa0\n")
    (tmp_path / "params.yaml").write_bytes(data)
    line, column = _where(data, b"\xa0")
    status, lines = _cli(["check"], tmp_path)
    assert status == 2 and lines == [
        f"error: params.yaml: key 'finetune.batch_size', line {line}, "
        f"column {column}: byte 0xa0 is not UTF-8 (save the file as UTF-8)"
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["params.yaml"] and (tmp_path / "params.yaml").read_bytes() == data


# ---------------------------------------------------------------- a key written twice
def _line_of(text: str, needle: str, nth: int = 0) -> int:
    lines = [i + 1 for i, line in enumerate(text.splitlines()) if line == needle]
    return lines[nth]


@pytest.mark.parametrize(
    "edit, key, needle",
    [
        (lambda t: t.replace("  lr: 0.0003\n", "  lr: 0.0003\n  lr: 0.1\n"), "finetune.lr", "  lr: 0.0003|  lr: 0.1"),
        (lambda t: t + "seed: 7\n", "seed", "seed: 0|seed: 7"),
        (lambda t: t.replace("suite:\n", "suite:\n  n_val: 9\n", 1), "suite.n_val", "  n_val: 9|  n_val: 200"),
    ],
)
def test_a_key_written_twice_is_refused_naming_it_and_both_lines(tmp_path, repo_root, edit, key, needle):
    text = edit((repo_root / "params.yaml").read_text())
    (tmp_path / "params.yaml").write_text(text)
    first, second = (_line_of(text, n) for n in needle.split("|"))
    expected = f"duplicate key '{key}' (lines {first} and {second}; the later one would silently win)"
    with pytest.raises(MergeflowError) as err:
        load_params(tmp_path / "params.yaml")
    assert str(err.value) == f"{tmp_path / 'params.yaml'}: {expected}"
    # dvc exp run -S's way (apply_overrides, ruamel's round trip) refuses it too and leaves the file as it was
    with pytest.raises(MergeflowError) as err:
        apply_overrides(tmp_path / "params.yaml", ["finetune.steps=3"])
    assert str(err.value) == f"{tmp_path / 'params.yaml'}: {expected}"
    assert (tmp_path / "params.yaml").read_text() == text


def test_the_round_trip_reader_names_a_duplicate_key_too(tmp_path, repo_root, monkeypatch):
    """ruamel's reader behind apply_overrides, reached without the PyYAML check before it: still one line."""
    from mergeflow import params as params_module

    text = (repo_root / "params.yaml").read_text().replace("  lr: 0.0003\n", "  lr: 0.0003\n  lr: 0.1\n")
    (tmp_path / "params.yaml").write_text(text)
    monkeypatch.setattr(params_module, "load_params", lambda path: None)
    with pytest.raises(MergeflowError) as err:
        apply_overrides(tmp_path / "params.yaml", ["finetune.steps=3"])
    first, second = _line_of(text, "  lr: 0.0003"), _line_of(text, "  lr: 0.1")
    assert (
        str(err.value)
        == f"{tmp_path / 'params.yaml'}: the round-trip YAML reader refuses it: duplicate key 'finetune.lr' (lines "
        f"{first} and {second}; the later one would silently win)"
    )
    assert (tmp_path / "params.yaml").read_text() == text


def test_a_key_written_twice_in_an_override_or_in_dvc_yaml(tmp_path, repo_root):
    from mergeflow.runner.checks import check_project

    (tmp_path / "params.yaml").write_text((repo_root / "params.yaml").read_text())
    with pytest.raises(MergeflowError) as err:
        apply_overrides(tmp_path / "params.yaml", ["merge.ties={k: 0.1, k: 0.2}"])
    assert (
        str(err.value) == "override 'merge.ties={k: 0.1, k: 0.2}': duplicate key "
        "'k' (twice on line 1; the later one would silently win)"
    )
    dvc = (
        (repo_root / "dvc.yaml")
        .read_text()
        .replace("    cmd: mergeflow prepare\n", "    cmd: mergeflow prepare\n    cmd: mergeflow pretrain\n", 1)
    )
    (tmp_path / "dvc.yaml").write_text(dvc)
    first, second = _line_of(dvc, "    cmd: mergeflow prepare"), _line_of(dvc, "    cmd: mergeflow pretrain")
    with pytest.raises(MergeflowError) as err:
        check_project(tmp_path)
    assert (
        str(err.value) == f"{tmp_path / 'dvc.yaml'}: duplicate key 'stages.prepare.cmd' "
        f"(lines {first} and {second}; the later one would silently win)"
    )


# ---------------------------------------------------------------- a name listed twice
@pytest.mark.parametrize(
    "section, path, value, expected",
    [
        (
            "merge",
            ["merge", "methods"],
            ["ties", "task_arithmetic", "ties"],
            "params.yaml: merge.methods: method 'ties' is listed twice",
        ),
        (
            "regimes",
            ["regimes", "methods", "one_epoch"],
            ["ties", "ties"],
            "params.yaml: regimes.methods.one_epoch: method 'ties' is listed twice",
        ),
        (
            "regimes",
            ["regimes", "methods", "mima"],
            ["mima", "ties", "mima"],
            "params.yaml: regimes.methods.mima: method 'mima' is listed twice",
        ),
        (
            "regimes",
            ["regimes", "methods", "atm"],
            ["atm", "atm"],
            "params.yaml: regimes.methods.atm: method 'atm' is listed twice",
        ),
        (
            "studies",
            ["studies", "run"],
            ["mima", "cart", "mima"],
            "params.yaml: studies.run: study 'mima' is listed twice",
        ),
    ],
)
def test_a_name_listed_twice_is_refused(raw, section, path, value, expected):
    node = raw
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value
    assert _refused(raw) == expected
    node[path[-1]] = list(dict.fromkeys(value))
    parse_params(raw)


# ---------------------------------------------------------------- counts and sizes with an upper bound
BOUNDS = [  # key, the bound, its unit: generous for two cores or a GPU node, and each said in the message
    ("seed", 4_294_967_295, "(the seed range of numpy and scikit-learn)"),
    ("suite.n_train", 100_000_000, "images"),
    ("suite.n_val", 100_000_000, "images"),
    ("suite.n_test", 100_000_000, "images"),
    ("suite.pretrain_images", 100_000_000, "images"),
    ("pretrain.steps", 10_000_000, "steps"),
    ("pretrain.warmup_steps", 10_000_000, "steps"),
    ("pretrain.epochs", 10_000_000, "epochs"),
    ("pretrain.batch_size", 1_000_000, "examples"),
    ("finetune.steps", 10_000_000, "steps"),
    ("finetune.warmup_steps", 10_000_000, "steps"),
    ("finetune.epochs", 10_000_000, "epochs"),
    ("finetune.batch_size", 1_000_000, "examples"),
    ("finetune.preserve_features.images", 100_000_000, "images"),
    ("finetune.preserve_features.batch_size", 1_000_000, "images"),
    ("probe.max_iter", 10_000_000, "iterations"),
    ("statistics.examples", 100_000_000, "examples"),
    ("runtime.threads", 4096, "threads"),
    ("runtime.eval_batch_size", 1_000_000, "examples"),
    ("regimes.atm.steps", 10_000_000, "steps"),
    ("regimes.mima.rounds.0", 10_000_000, "rounds"),
    ("regimes.atm.rounds.0", 10_000_000, "rounds"),
]


def _set(raw, dotted, value):
    """Set a dotted key of params; a last part that is an index (rounds.0) sets a one-item list."""
    parts = dotted.split(".")
    if parts[-1].isdigit():
        parts, value = parts[:-1], [value]
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


@pytest.mark.parametrize("key, bound, unit", BOUNDS)
def test_every_count_and_size_has_an_upper_bound_said_in_the_message(raw, key, bound, unit):
    raw["regimes"]["run"] = []  # rounds are checked against finetune.steps only for regimes that run
    if key.startswith("regimes.mima.rounds"):
        raw["regimes"]["mima"] = {}
    elif key.startswith("regimes.atm.rounds"):
        raw["regimes"]["atm"] = {}
    for value, shown in ((1e29, "1e+29"), (10**30, str(10**30)), ("1e29", "'1e29'"), (bound + 1, str(bound + 1))):
        _set(raw, key, value)
        assert _refused(raw) == f"params.yaml: {key}: at most {bound:,} {unit} (got {shown})", value
    _set(raw, key, bound)
    parse_params(raw)


def test_a_count_written_as_1e29_in_params_yaml_through_the_cli(tmp_path, repo_root):
    text = (repo_root / "params.yaml").read_text().replace("  warmup_steps: 45\n", "  warmup_steps: 1e29\n")
    (tmp_path / "params.yaml").write_text(text)
    status, lines = _cli(["check"], tmp_path)
    assert status == 2 and lines == ["error: params.yaml: pretrain.warmup_steps: at most 10,000,000 steps (got '1e29')"]
    assert [p.name for p in tmp_path.iterdir()] == ["params.yaml"]


def test_threads_from_the_environment_are_bounded_too(raw, monkeypatch):
    params = parse_params(raw | {"runtime": raw["runtime"] | {"deterministic": False}})
    for env in ("0", "1e30", "abc", str(10**30)):
        monkeypatch.setenv("MERGEFLOW_THREADS", env)
        with pytest.raises(MergeflowError) as err:
            params.threads()
        assert (
            str(err.value) == f"MERGEFLOW_THREADS={env!r}: expected a whole number of "
            "threads from 1 to 4,096 (it overrides runtime.threads)"
        )
    monkeypatch.setenv("MERGEFLOW_THREADS", "3")
    assert params.threads() == 3
    # deterministic: the count decides the bits, so it comes from params.yaml alone (2 unless runtime.threads says)
    assert parse_params(raw).threads() == 2
    assert parse_params(raw | {"runtime": raw["runtime"] | {"threads": 5}}).threads() == 5


def test_a_large_seed_reaches_the_probe_within_scikit_learns_range():
    """A task's seed is seed x 1000003 + crc32(task): from seed 4295 on it passes scikit-learn's 2**32 - 1."""
    import torch

    from mergeflow.config import ProbeConfig
    from mergeflow.ml.probes import fit_probe

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 3, generator=gen), torch.arange(40) % 2
    result = fit_probe(x, y, x, y, ProbeConfig(c_grid=[1.0], max_iter=20), seed=4_294_967_295 * 1_000_003 + 12345)
    assert result.head.weight.shape == (2, 3)


# ---------------------------------------------------------------- NaN, infinity, probe.c_grid
@pytest.mark.parametrize(
    "dotted, value, expected",
    [
        (
            "probe.c_grid",
            [0.1, math.nan],
            "params.yaml: probe.c_grid.1: nan is not a finite number "
            "(NaN and infinity are refused everywhere in the params)",
        ),
        (
            "finetune.lr",
            math.inf,
            "params.yaml: finetune.lr: inf is not a finite number "
            "(NaN and infinity are refused everywhere in the params)",
        ),
        (
            "finetune.weight_decay",
            -math.inf,
            "params.yaml: finetune.weight_decay: -inf is not a finite "
            "number (NaN and infinity are refused everywhere in the params)",
        ),
        (
            "merge.ties",
            {"k": math.nan},
            "params.yaml: merge.ties.k: nan is not a finite number "
            "(NaN and infinity are refused everywhere in the params)",
        ),
        (
            "backbone.kwargs",
            {"drop_rate": math.nan},
            "params.yaml: backbone.kwargs.drop_rate: nan is not a finite "
            "number (NaN and infinity are refused everywhere in the params)",
        ),
        ("probe.c_grid", [0.1, 0.0], "params.yaml: probe.c_grid.1: Input should be greater than 0 (got 0.0)"),
        ("probe.c_grid", [-1.0], "params.yaml: probe.c_grid.0: Input should be greater than 0 (got -1.0)"),
        (
            "finetune.lr",
            "inf",
            "params.yaml: finetune.lr: Input should be a finite number (got 'inf')",
        ),  # YAML's `inf` is a string
        (
            "studies",
            {"mima": {"individual_tolerance": "nan"}},
            "params.yaml: studies.mima.individual_tolerance: Input should be a finite number",
        ),
    ],
)
def test_nan_infinity_and_c_grid(raw, dotted, value, expected):
    _set(raw, dotted, value)
    assert _refused(raw) == expected


def test_nan_written_as_yaml_in_params_yaml(tmp_path, repo_root):
    text = (repo_root / "params.yaml").read_text().replace("  - 10.0\n", "  - .nan\n", 1)
    (tmp_path / "params.yaml").write_text(text)
    with pytest.raises(MergeflowError) as err:
        load_params(tmp_path / "params.yaml")
    index = yaml.safe_load((repo_root / "params.yaml").read_text())["probe"]["c_grid"].index(10.0)
    assert (
        str(err.value)
        == f"{tmp_path / 'params.yaml'}: probe.c_grid.{index}: nan is not a finite number (NaN and infinity are "
        "refused everywhere in the params)"
    )


# ---------------------------------------------------------------- a study's settings that are not a mapping
def test_a_studys_settings_must_be_a_mapping(raw):
    raw["studies"] = {"run": ["mima"], "mima": "abc"}
    assert (
        _refused(raw)
        == "params.yaml: studies.mima: expected a mapping of the study's settings (key: value lines), got 'abc'"
    )
    raw["studies"]["mima"] = [1, 2]
    assert (
        _refused(raw)
        == "params.yaml: studies.mima: expected a mapping of the study's settings (key: value lines), got [1, 2]"
    )
    raw["studies"]["mima"] = None  # an empty entry: the study's defaults
    assert parse_params(raw).studies.settings("mima") == parse_params(
        raw | {"studies": {"run": ["mima"]}}
    ).studies.settings("mima")


# ---------------------------------------------------------------- a loss that becomes NaN
def _diverging(cfg):
    """A linear regression trained with ``cfg``: its loss at each step, and the error train_loop raised."""
    import torch

    from mergeflow.ml.training import train_loop

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    with pytest.raises(MergeflowError) as err:
        train_loop(
            model,
            lambda idx: ((model(x[idx]) - y[idx]) ** 2).mean(),
            64,
            cfg,
            optimizer=cfg.optimizer if hasattr(cfg, "optimizer") else "adamw",
            seed=0,
            device=torch.device("cpu"),
            desc="finetune digits",
        )
    return str(err.value)


def test_a_nan_loss_names_the_learning_rate_and_weight_decay():
    import re

    from mergeflow.config import FinetuneConfig, PretrainConfig

    # a rate far above params.yaml's bound (100), built as code may build it: the message is what is tested
    message = _diverging(
        FinetuneConfig.model_construct(
            optimizer="sgd", steps=50, batch_size=16, lr=1e20, weight_decay=0.25, warmup_steps=0, epochs=None
        )
    )
    assert re.fullmatch(
        r"finetune digits: loss became (nan|inf) at step [1-9]\d*: likely finetune\.lr = 1e\+20 is too high \(or "
        r"finetune\.weight_decay = 0\.25\); lower it",
        message,
    ), message
    message = _diverging(
        PretrainConfig.model_construct(steps=50, batch_size=16, lr=1e20, weight_decay=0.0, warmup_steps=0, epochs=None)
    )
    assert re.fullmatch(
        r"finetune digits: loss became (nan|inf) at step [1-9]\d*: likely pretrain\.lr = 1e\+20 is too high \(or "
        r"pretrain\.weight_decay = 0\); lower it",
        message,
    ), message


def test_a_loss_that_is_nan_before_any_update_is_not_blamed_on_the_learning_rate():
    import torch

    from mergeflow.config import FinetuneConfig
    from mergeflow.ml.training import train_loop

    model = torch.nn.Linear(2, 1)
    with pytest.raises(MergeflowError) as err:
        train_loop(
            model,
            lambda idx: model(torch.full((len(idx), 2), math.nan)).mean(),
            8,
            FinetuneConfig(steps=3, batch_size=4),
            optimizer="adamw",
            seed=0,
            device=torch.device("cpu"),
            desc="finetune signs",
        )
    assert (
        str(err.value) == "finetune signs: loss became nan at step 0, before any update (so not finetune.lr or "
        "finetune.weight_decay): the starting weights or the inputs hold NaN or infinity"
    )


# ---------------------------------------------------------------- aliases that expand without bound
def test_an_alias_bomb_is_refused_in_one_line_naming_its_key(tmp_path, repo_root):
    """A "billion laughs" params.yaml (anchors of anchors, 9^9 values in probe.c_grid) hung `mergeflow check`,
    the stages and DVC's reader: it is refused before anything walks it, naming the smallest list that is too large."""
    anchors = "x0: &l0 [0.1, 1.0, 10.0, 0.1, 1.0, 10.0, 0.1, 1.0, 10.0]\n" + "".join(
        f"x{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]\n" for i in range(1, 9)
    )
    text = (
        (repo_root / "params.yaml")
        .read_text()
        .replace(
            "probe:\n  c_grid:\n  - 0.1\n  - 1.0\n  - 10.0\n",
            "probe:\n  c_grid: &l9 [*l8, *l8, *l8, *l8, *l8, *l8, *l8, *l8, *l8]\n",
        )
    )
    (tmp_path / "params.yaml").write_text(anchors + text)
    status, lines = _cli(["check"], tmp_path)
    size = 10  # x0: the list and its 9 values; each next anchor: a list of 9 of the one before
    for _ in range(6):
        size = 1 + 9 * size
    assert status == 2 and lines == [
        f"error: params.yaml: key 'x6', line 7: its aliases expand to {size:,} values (at most 1,000,000): an alias "
        "bomb, not a configuration (DVC's own reader would expand it too)"
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["params.yaml"]
    # a file with anchors that stays small is read as before
    from mergeflow.core.yaml_files import parse_yaml

    assert parse_yaml("a: &a [1, 2]\nb: [*a, *a]\n", "small.yaml") == {"a": [1, 2], "b": [[1, 2], [1, 2]]}
