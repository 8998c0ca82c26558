"""deepspec/files.py: the atomic directory writer."""
import os
import stat

import pytest

from deepspec.errors import DeepSpecError
from deepspec.files import atomic_dir


def test_atomic_dir_replaces_only_on_success(tmp_path):
    out = tmp_path / "model"
    with atomic_dir(out) as tmp:
        assert tmp.parent == tmp_path and tmp.is_dir() and not out.exists()
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"] and (out / "config.json").read_text() == "{}"
    mode = stat.S_IMODE(out.stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o777 & ~umask  # as mkdir would make it, not mkdtemp's 0700

    with pytest.raises(DeepSpecError, match=r"output .*model exists \(use --overwrite\)"):
        with atomic_dir(out) as tmp:
            (tmp / "config.json").write_text("new")
    with pytest.raises(RuntimeError):
        with atomic_dir(out, overwrite=True) as tmp:
            (tmp / "config.json").write_text("new")
            raise RuntimeError("killed half-way")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"] and (out / "config.json").read_text() == "{}"

    with atomic_dir(out, overwrite=True) as tmp:
        (tmp / "weights").write_text("w")
    assert sorted(p.name for p in out.iterdir()) == ["weights"]


def test_atomic_dir_merge_moves_config_json_last(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "train_log.csv").write_text("kept")
    (out / "model.safetensors").write_text("old")
    moved = []
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (moved.append(os.path.basename(b)), replace(a, b)))
    with atomic_dir(out, merge=True) as tmp:
        assert tmp.parent == out
        for name in ("config.json", "model.safetensors", "a.json"):
            (tmp / name).write_text("new")
    assert moved == ["a.json", "model.safetensors", "config.json"]
    assert sorted(p.name for p in out.iterdir()) == ["a.json", "config.json", "model.safetensors", "train_log.csv"]
    assert (out / "model.safetensors").read_text() == "new" and (out / "train_log.csv").read_text() == "kept"
