"""The trainer: schedule, data order, gradient accumulation, exact resume, and
the `python -m deepspec train` path on the tiny target.

The loop tests use a small stand-in PreTrainedModel (a frozen embedding, as the
drafters share the target's, plus a trainable MLP head) and a handmade dataset,
so they exercise the real checkpoint code (save_pretrained, safetensors) in a
second or two.
"""
import csv
import json
import math
import os
import re

import pytest
import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from deepspec.config import load_config
from deepspec.training import loop as T
from deepspec.training import recipe as R
from deepspec.training import run as TR
from deepspec.training.stopping import TrainingStopped
from deepspec.training.train_log import TIMING_COLS

from helpers import CONVERSATIONS, write_conversations

# --------------------------------------------------------------------------- stand-ins


class ToyConfig(PretrainedConfig):
    model_type = "deepspec_toy"

    def __init__(self, vocab=32, dim=16, **kw):
        self.vocab, self.dim = vocab, dim
        super().__init__(**kw)


class ToyModel(PreTrainedModel):
    config_class = ToyConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab, config.dim)
        self.embed.requires_grad_(False)  # frozen, like the target's embedding
        self.mlp = nn.Sequential(nn.Linear(config.dim, config.dim), nn.Tanh(), nn.Dropout(0.1))
        self.head = nn.Linear(config.dim, config.vocab)
        self.post_init()

    def _init_weights(self, module):  # keep torch's default init (seeded below)
        pass

    def forward(self, input_ids):
        return self.head(self.mlp(self.embed(input_ids)))


def toy_model(seed=0):
    torch.manual_seed(seed)
    return ToyModel(ToyConfig())


def toy_dataset(n=24, length=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32, (n, length), generator=g)
    return [{"input_ids": ids[i], "loss_mask": torch.ones(length, dtype=torch.bool)} for i in range(n)]


def collate(samples):
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def make_step_fn(use_rng: bool):
    """Next-token CE, mean per sequence then mean over sequences (so a micro
    batch of 4 equals 4 accumulated micro batches of 1). With use_rng the
    positions are weighted by noise from the anchor generator and dropout
    (global torch RNG) is on, so resuming must restore both."""

    def step_fn(model, batch, generator, log_step=True):
        ids = batch["input_ids"]
        model.mlp[2].p = 0.1 if use_rng else 0.0
        logits = model(ids[:, :-1])
        ce = nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        if use_rng:
            ce = ce * torch.rand(ce.shape, generator=generator, device=ce.device) * 2
        loss = ce.mean(-1).mean()
        c1 = float(torch.exp(-loss.detach()))
        return loss, {"ce": float(loss.detach()), "c_star_1": c1, "tau_expected": 1.0 + c1}

    return step_fn


def train_cfg(**kw):
    """The tiny preset's train section with the loop's test settings and `kw`."""
    cfg = dict(load_config("tiny")["train"], lr=6e-4, weight_decay=0.0, warmup_ratio=0.04, grad_clip=1.0,
               global_batch=4, micro_batch=1, epochs=1, max_steps=None, seed=42, checkpoint_every=1000, log_every=1,
               keep_checkpoints=None,
               precision="float32")  # the loop's mechanics compared exactly, on any CPU (bf16: test_precision.py)
    cfg.update(kw)
    return cfg


def read_log(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def tensorboard_scalars(run_dir, tag="loss"):
    """[(step, value)] of scalar `tag` in a TensorBoard run directory, as TensorBoard
    shows it (the steps a restarted run purged left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir))
    ea.Reload()
    return [(e.step, e.value) for e in ea.Scalars(tag)]


# --------------------------------------------------------------------------- schedule and order


def test_lr_schedule_warmup_then_cosine_to_zero():
    total = 100
    n_warm = R.warmup_steps(total, 0.04)
    assert n_warm == 4
    f = [R.lr_factor(s, total, n_warm) for s in range(total + 1)]
    assert f[:5] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    assert f[4 + 48] == pytest.approx(0.5)  # halfway through the cosine
    assert f[99] == pytest.approx(0.5 * (1 + math.cos(math.pi * 95 / 96)))
    assert f[99] > 0 and f[100] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(f[4:], f[5:]))  # monotone after warmup

    # The optimiser sees the same values, one per update.
    p = nn.Parameter(torch.zeros(1))
    opt, sched = R.make_optimizer([p], train_cfg(lr=1e-3), total)
    lrs = []
    for _ in range(total):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([1e-3 * x for x in f[:total]])
    assert R.warmup_steps(3, 0.04) == 1 and R.lr_factor(0, 3, 1) == 1.0


def test_optimizer_is_fused_adamw_with_the_for_loop_update():
    """make_optimizer uses torch's fused AdamW on CPU; its updates equal the
    reference for-loop AdamW's (same lr schedule) up to rounding."""
    g = torch.Generator().manual_seed(0)
    init = torch.randn(64, 48, generator=g)
    grads = [torch.randn(64, 48, generator=g) * (torch.rand(64, 48, generator=g) < 0.2) for _ in range(12)]
    p = nn.Parameter(init.clone())
    opt, sched = R.make_optimizer([p], train_cfg(lr=1e-2), 12)
    assert opt.defaults["fused"] is True
    q = nn.Parameter(init.clone())
    ref = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.0, foreach=False)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, sched.lr_lambdas[0])
    for grad in grads:
        p.grad, q.grad = grad.clone(), grad.clone()
        opt.step(), sched.step(), ref.step(), ref_sched.step()
    assert not torch.equal(p.detach(), init)
    torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)


def test_plan_steps_and_sampler():
    assert R.plan_steps(10, train_cfg(global_batch=4)) == (2, 2)
    assert R.plan_steps(10, train_cfg(global_batch=4, epochs=1.5)) == (2, 3)
    assert R.plan_steps(1000, train_cfg(global_batch=4, epochs=10, max_steps=7)) == (250, 7)
    assert R.plan_steps(3, train_cfg(global_batch=4)) == (1, 1)
    with pytest.raises(T.DeepSpecError):
        R.plan_steps(0, train_cfg())

    s = T.StepSampler(10, 4, seed=42)
    e0 = s.indices(0) + s.indices(1)
    assert len(set(e0)) == 8 and all(0 <= i < 10 for i in e0)  # no repeats within an epoch
    assert s.indices(2) != s.indices(0)  # epoch 1 reshuffles
    assert T.StepSampler(10, 4, seed=42).indices(3) == s.indices(3)  # position = step: restartable
    assert T.StepSampler(10, 4, seed=43).indices(0) != s.indices(0)
    assert len(T.StepSampler(3, 8, seed=0).indices(0)) == 8  # N < global batch still fills a step
    assert R.split_batch(list(range(8)), rank=1, world=2, micro=2) == [(2, [4, 5]), (3, [6, 7])]
    assert R.split_batch(list(range(8)), rank=0, world=1, micro=2)[2:] == [(2, [4, 5]), (3, [6, 7])]  # same index
    with pytest.raises(T.DeepSpecError, match="global_batch"):
        R.accumulation_steps(train_cfg(global_batch=6, micro_batch=4), world=1)


# --------------------------------------------------------------------------- the loop


def test_gradient_accumulation_matches_one_big_micro_batch(tmp_path):
    data = toy_dataset()
    finals = []
    for micro in (1, 4):
        model = toy_model()
        T.train(model, data, make_step_fn(False), train_cfg(micro_batch=micro, max_steps=3, lr=1e-2),
                tmp_path / f"m{micro}", collate_fn=collate)
        finals.append({n: p.detach().clone() for n, p in model.named_parameters()})
    a, b = finals
    assert not torch.equal(a["head.weight"], toy_model().head.weight)  # it trained
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-6, msg=n)


def test_kill_and_resume_is_bit_identical(tmp_path):
    data = toy_dataset()
    cfg = train_cfg(checkpoint_every=2, epochs=2, lr=1e-2)  # 6 steps/epoch -> 12 steps
    step_fn = make_step_fn(True)

    ref = toy_model()
    res = T.train(ref, data, step_fn, cfg, tmp_path / "ref", collate_fn=collate)
    assert res.steps == 12 and res.steps_this_process == 12

    out = tmp_path / "killed"
    micro_per_step = cfg["global_batch"] // cfg["micro_batch"]
    calls = []

    def dies_in_step_6(model, batch, generator, log_step=True):  # between the checkpoints at 4 and 6
        calls.append(1)
        if len(calls) > 5 * micro_per_step:
            raise RuntimeError("injected failure after step 5")
        return step_fn(model, batch, generator, log_step=log_step)

    with pytest.raises(RuntimeError, match="injected failure after step 5"):
        T.train(toy_model(), data, dies_in_step_6, cfg, out, collate_fn=collate)
    assert not (out / "config.json").exists()  # incomplete runs have no config.json
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_4"
    assert len(read_log(out / T.LOG_NAME)) == 5

    torch.manual_seed(123)  # a different process state: all of it must come from the checkpoint
    resumed = toy_model(seed=7)
    res2 = T.train(resumed, data, step_fn, cfg, out, collate_fn=collate)  # auto-resume
    assert res2.steps == 12 and res2.steps_this_process == 8

    for (n, p), (_, q) in zip(ref.named_parameters(), resumed.named_parameters()):
        assert torch.equal(p, q), n
    rows_ref, rows_res = read_log(tmp_path / "ref" / T.LOG_NAME), read_log(out / T.LOG_NAME)
    assert [r["step"] for r in rows_res] == [str(s) for s in range(1, 13)]
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING_COLS} for r in rows]  # noqa: E731
    assert strip(rows_ref) == strip(rows_res)

    # The final drafter is a complete save_pretrained directory.
    loaded = ToyModel.from_pretrained(str(out))
    for (n, p), (_, q) in zip(ref.named_parameters(), loaded.named_parameters()):
        assert torch.equal(p, q), n
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 12 and "commit" in summary["code"]
    assert summary["precision"] == {"device": "cpu", "processes": 1, "mixed_precision": "no", "param_dtype": "float32"}
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "latest", "step_10", "step_12", "step_2", "step_4", "step_6", "step_8"]


def test_tensorboard_has_the_log_rows_and_a_resume_shows_each_step_once(tmp_path):
    """Every train_log.csv row is in <out>/tensorboard/<out name>/ as scalars at its
    step (accelerate's tracker). A run killed in step 6 has logged step 5 after its
    checkpoint at 4; the resumed run logs 5 and 6 again, in a new event file, and
    TensorBoard shows each step once (purge_step), as the log does. The event files
    stay beside the final drafter; a fresh start drops them with the log."""
    data = toy_dataset()
    cfg = train_cfg(checkpoint_every=2, lr=1e-2)  # 6 steps, checkpoints at 2, 4, 6
    step_fn = make_step_fn(True)
    out, calls = tmp_path / "run", []

    def dies_in_step_6(model, batch, generator, log_step=True):
        calls.append(1)
        if len(calls) > 5 * 4:
            raise RuntimeError("killed")
        return step_fn(model, batch, generator, log_step=log_step)

    with pytest.raises(RuntimeError, match="killed"):
        T.train(toy_model(), data, dies_in_step_6, cfg, out, collate_fn=collate)
    run_dir = out / "tensorboard" / "run"
    assert [s for s, _ in tensorboard_scalars(run_dir)] == [1, 2, 3, 4, 5]
    T.train(toy_model(), data, step_fn, cfg, out, collate_fn=collate)
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2
    rows = read_log(out / T.LOG_NAME)
    for col in ("loss", "lr", "c_star_1", "tau_expected", "grad_norm"):
        got = tensorboard_scalars(run_dir, col)
        assert [s for s, _ in got] == [1, 2, 3, 4, 5, 6], col
        assert [v for _, v in got] == pytest.approx([float(r[col]) for r in rows], rel=1e-6), col
    assert (out / "config.json").exists() and sorted(p.name for p in (out / "tensorboard").iterdir()) == ["run"]

    T.train(toy_model(), data, step_fn, train_cfg(checkpoint_every=2, lr=5e-2), out, collate_fn=collate)
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1
    assert [v for _, v in tensorboard_scalars(run_dir, "lr")] == pytest.approx(
        [float(r["lr"]) for r in read_log(out / T.LOG_NAME)], rel=1e-6)


def test_training_without_tensorboard_warns_once_and_trains(tmp_path, monkeypatch, caplog):
    """Without the tensorboard package (nor tensorboardX) training runs as before,
    with one warning saying so, and writes no event files."""
    import sys

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # find_spec and import now fail
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with caplog.at_level("WARNING"):
        res = T.train(toy_model(), toy_dataset(n=8), make_step_fn(False), train_cfg(), tmp_path, collate_fn=collate)
    assert res.steps == 2 and (tmp_path / "config.json").exists() and len(read_log(tmp_path / T.LOG_NAME)) == 2
    assert caplog.text.count("no TensorBoard logging") == 1 and "pip install tensorboard" in caplog.text
    assert not (tmp_path / "tensorboard").exists()


def test_resume_flags(tmp_path):
    data = toy_dataset(n=8)
    with pytest.raises(T.DeepSpecError, match="no checkpoint"):
        T.train(toy_model(), data, make_step_fn(False), train_cfg(), tmp_path, collate_fn=collate, resume=True)
    T.train(toy_model(), data, make_step_fn(False), train_cfg(keep_checkpoints=1, checkpoint_every=1),
            tmp_path, collate_fn=collate)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_2"]
    res = T.train(toy_model(), data, make_step_fn(False), train_cfg(global_batch=8), tmp_path,
                  collate_fn=collate, resume=False)
    assert res.steps == 1 and len(read_log(tmp_path / T.LOG_NAME)) == 1
    header = next(csv.reader(open(tmp_path / T.LOG_NAME)))
    assert header[:4] == ["step", "epoch", "lr", "loss"] and "c_star_1" in header and "tau_expected" in header


@pytest.mark.parametrize("change", [dict(lr=5e-2), dict(epochs=2), dict(global_batch=2), dict(seed=1)])
def test_changed_settings_never_resume(tmp_path, caplog, change):
    """A finished run rerun with another setting trains afresh (and says so);
    with --resume it refuses. The same setting resumes (nothing left to do)."""
    data = toy_dataset(n=8)
    T.train(toy_model(), data, make_step_fn(False), train_cfg(lr=1e-2), tmp_path, collate_fn=collate)
    same = T.train(toy_model(), data, make_step_fn(False), train_cfg(lr=1e-2), tmp_path, collate_fn=collate)
    assert same.steps_this_process == 0
    with pytest.raises(T.DeepSpecError, match="settings or data changed"):
        T.train(toy_model(), data, make_step_fn(False), train_cfg(**{"lr": 1e-2, **change}), tmp_path, collate_fn=collate,
                resume=True)
    fresh = toy_model()
    res = T.train(fresh, data, make_step_fn(False), train_cfg(**{"lr": 1e-2, **change}), tmp_path, collate_fn=collate)
    assert res.steps_this_process == res.steps > 0 and "settings or data changed" in caplog.text
    ref = toy_model()
    T.train(ref, data, make_step_fn(False), train_cfg(**{"lr": 1e-2, **change}), tmp_path / "ref", collate_fn=collate)
    for (n, p), (_, q) in zip(ref.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p, q), n  # exactly a run from scratch with the new settings


def test_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    data = toy_dataset()
    cfg = train_cfg(checkpoint_every=2, lr=1e-2)  # 6 steps, checkpoints at 2, 4, 6
    step_fn = make_step_fn(True)
    ref = toy_model()
    T.train(ref, data, step_fn, cfg, tmp_path / "ref", collate_fn=collate)
    out = tmp_path / "run"
    calls = []

    def dies_in_step_6(model, batch, generator, log_step=True):
        calls.append(1)
        if len(calls) > 5 * 4:
            raise RuntimeError("killed")
        return step_fn(model, batch, generator, log_step=log_step)

    with pytest.raises(RuntimeError, match="killed"):
        T.train(toy_model(), data, dies_in_step_6, cfg, out, collate_fn=collate)
    shard = out / "checkpoints" / "step_4" / "model.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0xFF  # flip bits in a tensor: loads fine, but is not what was saved
    shard.write_bytes(bytes(raw))
    resumed = toy_model(seed=5)
    res = T.train(resumed, data, step_fn, cfg, out, collate_fn=collate)
    assert res.steps_this_process == 4 and "step_4/model.safetensors is damaged" in caplog.text
    for (n, p), (_, q) in zip(ref.named_parameters(), resumed.named_parameters()):
        assert torch.equal(p, q), n  # resumed from step 2, still bit-identical
    # every checkpoint damaged: --resume refuses with one line, the default starts afresh
    (out / "checkpoints" / "step_6" / "optimizer.pt").unlink()
    (out / "checkpoints" / "step_4" / "trainer_state.json").write_text("{not json")
    (out / "checkpoints" / "step_2" / "scheduler.pt").write_bytes(b"x")
    with pytest.raises(T.DeepSpecError, match="every checkpoint is damaged"):
        T.train(toy_model(), data, step_fn, cfg, out, collate_fn=collate, resume=True)
    assert T.train(toy_model(), data, step_fn, cfg, out, collate_fn=collate).steps_this_process == 6


def test_a_second_trainer_of_the_same_directory_stops(tmp_path):
    import fcntl

    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / ".train.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(T.DeepSpecError, match="another training run is writing"):
            T.train(toy_model(), toy_dataset(n=8), make_step_fn(False), train_cfg(), tmp_path, collate_fn=collate)
    T.train(toy_model(), toy_dataset(n=8), make_step_fn(False), train_cfg(), tmp_path, collate_fn=collate)


def test_disk_full_at_a_checkpoint_names_it_and_leaves_no_partial(tmp_path, monkeypatch):
    """F1: safetensors reports a full disk as a SafetensorError ('... (os error
    28)'), not an OSError: the CLI's one line needs an OSError naming the
    checkpoint, and the half-written .step_N.partial goes."""
    import errno

    def full(self, path, **kw):
        (tmp_path / "seen").write_text(path)
        open(f"{path}/model.safetensors", "wb").write(b"half")
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(ToyModel, "save_pretrained", full)
    out = tmp_path / "run"
    with pytest.raises(OSError) as e:
        T.train(toy_model(), toy_dataset(n=8), make_step_fn(False), train_cfg(checkpoint_every=1), out,
                collate_fn=collate)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(out / "checkpoints" / "step_1")
    assert (tmp_path / "seen").read_text().endswith(".step_1.partial")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == []
    assert not (out / "config.json").exists()


# --------------------------------------------------------------------------- the real thing






def cli_argv(tmp_path, tiny_cfg, method, *extra):
    """`python -m deepspec train` arguments: tiny preset, online mode, results under tmp_path."""
    write_conversations(tmp_path / "results" / "tiny" / "regen" / "conversations.jsonl")
    sets = [f"resources_dir={tiny_cfg['resources_dir']}", f"data.root={tiny_cfg['data']['root']}",
            f"results_dir={tmp_path / 'results'}", "cache.mode=online", "train.global_batch=2", *extra]
    return ["--preset", "tiny", "--method", method, *[x for kv in sets for x in ("--set", kv)]]


def test_cli_train_dspark_online_on_tiny_target(tmp_path, tiny_cfg, tiny_target):
    from deepspec.drafters import load_drafter

    argv = cli_argv(tmp_path, tiny_cfg, "dspark", "train.checkpoint_every=1") + ["--max-steps", "2"]
    assert TR.cli_train(argv) == 0

    out = tmp_path / "results" / "tiny" / "drafters" / "dspark"
    drafter = load_drafter(out, tiny_target)
    assert drafter.method == "dspark"
    rows = read_log(out / T.LOG_NAME)
    assert [r["step"] for r in rows] == ["1", "2"]
    gamma = tiny_cfg["drafter"]["block_size"]
    for col in ["lr", "loss", "loss_ce", "loss_l1", "loss_conf", "c_star_1", f"c_star_{gamma}", "tau_expected",
                "positions_per_s", "elapsed_s"]:
        assert col in rows[0], col
    assert all(math.isfinite(float(r["loss"])) and 1.0 <= float(r["tau_expected"]) <= gamma + 1 for r in rows)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_2"
    # the same rows as TensorBoard scalars, in the drafter's directory (which loads with them there)
    events = out / "tensorboard" / "dspark"
    assert tensorboard_scalars(events, "loss") == [(int(r["step"]), pytest.approx(float(r["loss"]), rel=1e-6))
                                                   for r in rows]
    assert [s for s, _ in tensorboard_scalars(events, "c_star_1")] == [1, 2]

    # Rerunning resumes from the last checkpoint: nothing left to train, same weights.
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    assert TR.cli_train(argv) == 0
    again = load_drafter(out, tiny_target)
    assert all(torch.equal(before[n], p) for n, p in again.named_parameters())
    assert len(read_log(out / T.LOG_NAME)) == 2
    assert len(list(events.glob("events.out.tfevents.*"))) == 1  # no event file for no steps


def test_a_step_that_cannot_fit_in_memory_is_refused_before_training(tmp_path, tiny_cfg, tiny_target, monkeypatch):
    """C7: a global batch of 10^23 passed validation and grew until the kernel's
    OOM killer ended the run. The schema bounds the sizes; within them, a step
    whose memory (the plan's arithmetic, a lower bound) exceeds the machine's is
    one line naming the setting, before any step."""
    import copy

    from deepspec.config import load_config, parse_set
    from deepspec.drafters import build_drafter

    with pytest.raises(T.DeepSpecError, match=r"invalid value for 'train\.global_batch': 99999999999999999999999 is "
                                              r"greater than the maximum of 1048576"):
        load_config("tiny", parse_set(["train.global_batch=99999999999999999999999"]))
    cfg = copy.deepcopy(tiny_cfg)
    drafter = build_drafter("dspark", tiny_target, cfg)
    cpu = torch.device("cpu")
    parts = TR.check_step_memory(cfg, drafter, tiny_target, 12, cpu)  # the preset fits
    assert parts["adam_moments"] == 2 * parts["gradients"] > 0 and parts["target_weights"] > 0
    cfg["train"].update(global_batch=2**20, micro_batch=2**20)
    cfg["data"]["max_length"] = 2**20
    with pytest.raises(T.DeepSpecError, match=r"^a training step needs at least .* TiB but this machine has .*: .* TiB "
                                              r"of it a micro batch's cached features at data\.max_length; lower "
                                              r"train\.micro_batch or data\.max_length$"):
        TR.check_step_memory(cfg, drafter, tiny_target, 12, cpu)
    cfg["train"].update(micro_batch=1, processes=2)
    cfg["data"]["max_length"] = tiny_cfg["data"]["max_length"]
    monkeypatch.setattr(TR, "machine_memory", lambda device: (64 * 2**20, "this machine"))
    with pytest.raises(T.DeepSpecError, match=r"^a training step needs at least .* MiB \(2 processes\) but this machine "
                                              r"has 64\.0 MiB: .* MiB of it the data order of a global batch; lower "
                                              r"train\.global_batch$"):
        TR.check_step_memory(cfg, drafter, tiny_target, 12, cpu)
    # the train command checks before it trains: nothing is written
    argv = cli_argv(tmp_path, tiny_cfg, "dspark", "train.global_batch=1048576")
    with pytest.raises(T.DeepSpecError, match=r"lower train\.global_batch$"):
        TR.cli_train(argv)
    assert not (tmp_path / "results" / "tiny" / "drafters").exists()


def test_cli_train_variant_with_reduced_vocab(tmp_path, tiny_cfg, tiny_target):
    from deepspec.drafters import load_drafter

    argv = cli_argv(tmp_path, tiny_cfg, "eagle3-b2", "drafter.draft_vocab_size=64") + ["--max-steps", "1"]
    assert TR.cli_train(argv) == 0
    out = tmp_path / "results" / "tiny" / "drafters" / "eagle3-b2"
    drafter = load_drafter(out, tiny_target)
    assert drafter.method == "eagle3" and drafter.gamma == 2  # the variant's ttt_length
    assert not torch.equal(drafter.d2t, torch.arange(64))  # chosen from the token counts
    header = read_log(out / T.LOG_NAME)[0]
    assert "c_star_2" in header and "c_star_3" not in header and float(header["positions_per_s"]) > 0


def test_sigterm_checkpoints_stops_and_resumes_bit_identical(tmp_path):
    """SIGTERM mid-step (SLURM's warning before the time limit): the step finishes,
    a checkpoint of it is written, training stops with one line, and the rerun ends
    with the same weights as an uninterrupted run."""
    import os
    import signal

    data = toy_dataset()
    cfg = train_cfg(checkpoint_every=1000, epochs=2, lr=1e-2)  # no step checkpoint before the end
    step_fn = make_step_fn(True)
    ref = toy_model()
    T.train(ref, data, step_fn, cfg, tmp_path / "ref", collate_fn=collate)

    out, calls = tmp_path / "term", []
    micro_per_step = cfg["global_batch"] // cfg["micro_batch"]

    def term_in_step_5(model, batch, generator, log_step=True):
        calls.append(1)
        if len(calls) == 4 * micro_per_step + 2:  # inside step 5
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # repeats (the launcher's copy) change nothing
        return step_fn(model, batch, generator, log_step=log_step)

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(TrainingStopped, match="stopped by SIGTERM after step 5/12"):
        T.train(toy_model(), data, term_in_step_5, cfg, out, collate_fn=collate)
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is only active while training
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_5"
    assert len(calls) == 5 * micro_per_step and not (out / "config.json").exists()

    resumed = toy_model(seed=7)
    res = T.train(resumed, data, step_fn, cfg, out, collate_fn=collate)
    assert res.steps_this_process == 7
    for (n, p), (_, q) in zip(ref.named_parameters(), resumed.named_parameters()):
        assert torch.equal(p, q), n


def test_checkpoint_minutes_writes_timed_checkpoints(tmp_path, monkeypatch):
    """train.checkpoint_minutes: a checkpoint whenever that much training time has
    passed since the last one, whatever checkpoint_every says; each is deleted
    once a newer one is written (they exist only to resume)."""
    clock = iter(range(0, 10_000, 50))  # every reading of the clock is 50 s later
    monkeypatch.setattr(T.time, "monotonic", lambda: float(next(clock)))
    written = []
    save = T.save_checkpoint
    monkeypatch.setattr(T, "save_checkpoint", lambda run, step, elapsed, kind: written.append((step, kind))
                        or save(run, step, elapsed, kind))
    out = tmp_path / "timed"
    T.train(toy_model(), toy_dataset(), make_step_fn(False), train_cfg(checkpoint_every=1000, checkpoint_minutes=1.5),
            out, collate_fn=collate)
    # the clock moves 50 s per reading, one reading per step and one per checkpoint: 90 s pass every 2 steps
    assert written == [(2, "time"), (4, "time"), (6, "regular")]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_6"]


def test_checkpoints_are_pruned_to_a_bounded_number(tmp_path, monkeypatch):
    """Paper presets checkpoint every hour (0.9-6.6 TB unpruned): time and SIGTERM
    checkpoints go once a newer one is written, regular ones beyond the newest
    train.keep_checkpoints go, the newest (resumable) one always stays, and only
    the files a checkpoint lists as its own are deleted (a file of the user's
    inside a checkpoint directory stays, and with it the directory)."""
    import os
    import signal

    clock = iter(range(0, 100_000, 50))
    monkeypatch.setattr(T.time, "monotonic", lambda: float(next(clock)))
    data, out, calls = toy_dataset(), tmp_path / "run", []
    cfg = train_cfg(checkpoint_every=3, checkpoint_minutes=1.5, keep_checkpoints=1, epochs=2)  # 12 steps
    step_fn = make_step_fn(False)

    def user_file_then_term(model, batch, generator, log_step=True):
        calls.append(1)
        if len(calls) == 4 * 4 + 1:  # in step 5: step_3 (regular) exists; the user leaves a file in it
            (out / "checkpoints" / "step_3" / "notes.txt").write_text("mine")
        if len(calls) == 6 * 4 + 1:  # in step 7
            os.kill(os.getpid(), signal.SIGTERM)
        return step_fn(model, batch, generator, log_step=log_step)

    with pytest.raises(TrainingStopped):
        T.train(toy_model(), data, user_file_then_term, cfg, out, collate_fn=collate)
    ckpts = out / "checkpoints"
    # stopped after step 7: its SIGTERM checkpoint is the newest and stays; regular step_6 is the one kept;
    # the time checkpoints before it are gone; step_3 lost its checkpoint files but keeps the user's file
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_3", "step_6", "step_7"]
    assert [p.name for p in (ckpts / "step_3").iterdir()] == ["notes.txt"]
    assert json.loads((ckpts / "step_7" / "trainer_state.json").read_text())["kind"] == "sigterm"
    res = T.train(toy_model(), data, step_fn, cfg, out, collate_fn=collate)  # resumes from the SIGTERM checkpoint
    assert res.steps_this_process == 5
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_12", "step_3"]
    assert (ckpts / "step_3" / "notes.txt").read_text() == "mine"


def test_online_run_makes_the_target_forwards_plan_predicts(tmp_path, tiny_cfg, tiny_target, monkeypatch):
    """A short online run counts its target forwards (one per micro batch, over
    exactly that micro batch's sequences) in train_summary.json, and `plan`
    predicts that count for the same settings."""
    from deepspec.config import load_config, parse_set
    from deepspec.planning import plan as P

    calls = []
    unbound = type(tiny_target).features  # on the class: an instance patch would outlive the test
    monkeypatch.setattr(type(tiny_target), "features",
                        lambda self, ids, *a, **k: calls.append(ids.shape[0]) or unbound(self, ids, *a, **k))
    monkeypatch.setattr("deepspec.targets.loading.target_from_config", lambda cfg, **k: tiny_target)
    extra = ["train.global_batch=4", "train.micro_batch=2", "train.epochs=3"]
    argv = cli_argv(tmp_path, tiny_cfg, "dspark", *extra) + ["--max-steps", "3"]
    assert TR.cli_train(argv) == 0
    out = tmp_path / "results" / "tiny" / "drafters" / "dspark"
    summary = json.loads((out / "train_summary.json").read_text())
    assert calls == [2] * 6  # 3 steps x 2 micro batches of 2 sequences
    assert summary["online_target_forwards"] == 6
    assert 0 < summary["online_target_tokens"] <= summary["online_target_padded_tokens"]

    sets = [kv for kv in argv[argv.index("--set"):] if kv != "--set" and kv not in ("--max-steps", "3")]
    cfg = load_config("tiny", parse_set(sets + ["train.max_steps=3", f"plan.train_prompts={len(CONVERSATIONS)}"]))
    plan = P.build_plan(cfg, P.hardware(cfg), offline=True, methods=["dspark"])
    assert plan["training"]["methods"]["dspark"]["online_target_forwards"] == summary["online_target_forwards"]
    totals = plan["training"]["totals"]["dspark"]
    assert totals["total_flops_online"] - totals["total_flops_offline"] == 6 * plan["training"]["target_forward_flops_per_micro_batch"]


def test_training_lock_without_flock_trains_with_a_warning(tmp_path, monkeypatch, caplog):
    """NR12: on a filesystem without flock (ENOSYS, ENOLCK, EOPNOTSUPP) the training
    lock is skipped with a warning, as the token lock is; a held lock still stops a
    second trainer in one line, and any other error of flock is raised."""
    import errno
    import fcntl

    from deepspec.errors import DeepSpecError
    from deepspec.training import checkpoints as C

    real = fcntl.flock
    for code in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):
        def no_flock(f, op, code=code):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(fcntl, "flock", no_flock)
        ran = []
        with caplog.at_level("WARNING"), C.training_lock(tmp_path / "out"):
            ran.append(1)
        assert ran == [1] and "no file locks on this filesystem" in caplog.text
    monkeypatch.setattr(fcntl, "flock", lambda f, op: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(OSError, match="I/O error"), C.training_lock(tmp_path / "out"):
        pass
    monkeypatch.setattr(fcntl, "flock", real)
    with C.training_lock(tmp_path / "out"):
        with pytest.raises(DeepSpecError, match="another training run is writing"), C.training_lock(tmp_path / "out"):
            pass


def test_a_launcher_that_ignores_the_shutdown_timeout_is_named(monkeypatch, caplog):
    """NR13: the train rule's TORCH_ELASTIC_SHUTDOWN_TIMEOUT=600 needs a torch whose launcher
    reads it (LaunchConfig.shutdown_timeout; torch 2.13 has it). With several processes on
    one that does not, training says once that a SIGTERM checkpoint over 30 s is cut."""
    from deepspec.training import stopping

    assert stopping.launcher_honours_shutdown_timeout()  # the pinned torch
    assert not stopping.warn_if_sigterm_checkpoint_may_be_cut(8)
    monkeypatch.setattr(stopping, "launcher_honours_shutdown_timeout", lambda: False)
    assert not stopping.warn_if_sigterm_checkpoint_may_be_cut(1)
    with caplog.at_level("WARNING"):
        assert stopping.warn_if_sigterm_checkpoint_may_be_cut(8)
    assert "SIGKILL 30 s after SIGTERM" in caplog.text


def _saved_toy(path, **config):
    torch.manual_seed(0)
    ToyModel(ToyConfig(**config)).save_pretrained(str(path))
    return path


def test_resume_loader_refuses_a_misshapen_tensor_in_one_line(tmp_path):
    """A checkpoint tensor of another shape than the model's (a checkpoint of another
    drafter) is one line naming the checkpoint file, the tensor and both shapes, not
    torch's multi-line load_state_dict report."""
    from deepspec.errors import DeepSpecError
    from deepspec.training.checkpoints import load_model_weights

    ckpt = _saved_toy(tmp_path / "step_3", dim=8)
    with pytest.raises(DeepSpecError) as e:
        load_model_weights(toy_model(), ckpt)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{ckpt / 'model.safetensors'}: "), msg
    assert re.search(r": \S+\.weight is \[(32, )?8(, 8)?\], but the drafter being trained has \[(32, )?16(, 16)?\]", msg), msg
    ok = _saved_toy(tmp_path / "step_4")
    model = toy_model(seed=1)
    load_model_weights(model, ok)
    assert torch.equal(model.head.weight, toy_model(seed=0).head.weight)


def test_resume_loader_refuses_non_finite_weights(tmp_path):
    """A NaN in a checkpoint's weights (a diverged or damaged run) is not resumed: one
    line naming the checkpoint file and the tensor."""
    from safetensors.torch import load_file, save_file

    from deepspec.errors import DeepSpecError
    from deepspec.training.checkpoints import load_model_weights

    ckpt = _saved_toy(tmp_path / "step_3")
    f = ckpt / "model.safetensors"
    sd = load_file(str(f))
    sd["head.weight"][0, 0] = float("nan")
    save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(DeepSpecError) as e:
        load_model_weights(toy_model(), ckpt)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{f}: head.weight has 1 non-finite value"), msg
