"""deepspec/files.py: the atomic writers (directories, files), what they
replace, their file modes and their failures."""
import errno
import os
import stat

import pytest

from deepspec.errors import DeepSpecError
from deepspec.files import OUTPUT_MARKER, atomic_dir, atomic_path, check_overwrite, removed_on_failure


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
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, "weights"]


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
    # no marker: --overwrite never replaces a training run (its checkpoints) named as an output
    with pytest.raises(DeepSpecError, match="is not an output directory deepspec wrote"):
        check_overwrite(out, True)
    assert (out / "model.safetensors").read_text() == "new" and (out / "train_log.csv").read_text() == "kept"


def test_overwrite_replaces_only_a_directory_deepspec_wrote(tmp_path):
    """--overwrite onto an existing folder of someone else's (X2): refused in one
    line, its files untouched; onto a symlink or a file: refused; onto an
    output of ours (it holds OUTPUT_MARKER): replaced."""
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "notes.txt").write_text("precious")
    (victim / "sub" / "data.csv").write_text("data")
    with pytest.raises(DeepSpecError, match=rf"output {victim} is not an output directory deepspec wrote "
                                            rf"\(no {OUTPUT_MARKER} in it\): --overwrite replaces only") as e:
        with atomic_dir(victim, overwrite=True) as tmp:
            (tmp / "config.json").write_text("{}")
    assert "\n" not in str(e.value)
    assert (victim / "notes.txt").read_text() == "precious" and (victim / "sub" / "data.csv").read_text() == "data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim"]  # no temporary directory left
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(victim)
    for name, what in (("file", "not a directory"), ("link", "a symbolic link")):
        with pytest.raises(DeepSpecError, match=f"is {what}: --overwrite replaces only"):
            check_overwrite(tmp_path / name, True)
    (tmp_path / "empty").mkdir()  # as Snakemake makes it for an output file inside it
    with atomic_dir(tmp_path / "empty", overwrite=True) as tmp:
        (tmp / "config.json").write_text("{}")
    ours = tmp_path / "ours"
    with atomic_dir(ours) as tmp:
        (tmp / "old.json").write_text("{}")
    with atomic_dir(ours, overwrite=True) as tmp:
        (tmp / "new.json").write_text("{}")
    assert sorted(p.name for p in ours.iterdir()) == [OUTPUT_MARKER, "new.json"]


def test_outputs_get_the_umask_mode_whatever_wrote_them(tmp_path):
    """safetensors writes its files 0600 (F14); the directory writers give every
    file the mode open() gives under the umask, as atomic_path does."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    old = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "model") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
            (tmp / "sub").mkdir()
            save_file({"w": torch.zeros(2)}, str(tmp / "sub" / "x.safetensors"))
        with atomic_dir(tmp_path / "run", merge=True) as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
        with atomic_path(tmp_path / "one.safetensors") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp))
    finally:
        os.umask(old)
    for p in ("model/model.safetensors", "model/sub/x.safetensors", "run/model.safetensors", "one.safetensors"):
        assert stat.S_IMODE((tmp_path / p).stat().st_mode) == 0o644, p


def _fail(code):
    def write(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    return write


def test_write_failures_name_the_output_and_leave_nothing(tmp_path, monkeypatch):
    """Disk full or read-only (F1, F4, F5), also as safetensors and torch.save
    report it (not an OSError): an OSError naming the output, no temporary
    file or directory left."""
    out = tmp_path / "exp"
    cases = [OSError(errno.ENOSPC, "No space left on device", str(tmp_path / ".exp.x.partial" / "model.safetensors")),
             RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),
             OSError(errno.EROFS, "Read-only file system")]
    for err in cases:
        with pytest.raises(OSError) as e:
            with atomic_dir(out) as tmp:
                (tmp / "config.json").write_text("{}")
                raise err
        assert e.value.errno == err.errno if isinstance(err, OSError) else errno.ENOSPC
        assert e.value.filename == str(out)
        assert list(tmp_path.iterdir()) == []
    with pytest.raises(OSError) as e:
        with atomic_path(tmp_path / "t.csv", suffix=".csv") as tmp:
            tmp.write_text("half")
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp))
    assert e.value.filename == str(tmp_path / "t.csv") and list(tmp_path.iterdir()) == []
    # torch.save says only 'unexpected pos': disk full when the file system is
    monkeypatch.setattr("shutil.disk_usage", lambda p: type("U", (), {"free": 4096})())
    with pytest.raises(OSError, match="No space left on device") as e:
        with removed_on_failure(tmp_path / "ckpt.partial", tmp_path / "step_3"):
            (tmp_path / "ckpt.partial").mkdir()
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert e.value.filename == str(tmp_path / "step_3") and list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError):  # other errors pass as they are
        with removed_on_failure(None, tmp_path / "x"):
            raise ValueError("a bug")


def _cli_write_json(argv):
    from deepspec.files import write_json_atomic

    write_json_atomic(argv[0], {"a": 1})


@pytest.mark.parametrize("code,msg", [(errno.ENOSPC, r"disk full writing {out} \(No space left on device\); nothing "
                                                     r"half-written was kept: free space and rerun"),
                                      (errno.EROFS, r"{out}: Read-only file system; nothing half-written was kept"),
                                      (errno.EACCES, r"{out}: Permission denied; nothing half-written was kept")])
def test_cli_prints_a_write_failure_as_one_line(tmp_path, monkeypatch, capsys, code, msg):
    """The entry point turns a file system failure of any command (F5: every
    command on a read-only folder) into one line naming the output, exit 2.
    As root a chmod does not stop writes: the failure is injected into mkstemp."""
    import re
    import tempfile

    from deepspec import cli

    out = tmp_path / "plan.json"
    monkeypatch.setitem(cli.COMMANDS, "plan", (f"{__name__}:_cli_write_json", ""))
    monkeypatch.setattr(tempfile, "mkstemp", lambda *a, **k: (_ for _ in ()).throw(
        OSError(code, os.strerror(code), os.path.join(k["dir"], ".plan.json.abc.tmp"))))
    assert cli.main(["plan", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.fullmatch("deepspec plan: error: " + msg.format(out=re.escape(str(out))) + ".*", err), err
    assert list(tmp_path.iterdir()) == []
