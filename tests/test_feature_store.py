"""The feature store: the target's passes kept on disk and read back exactly; runs, epochs and
resumes that read it; the training device."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model
from train_cases import chat_prompts, examples, train_config

from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.train.batches import epoch_batches
from specdecode.train.checkpoint import TrainState
from specdecode.train.compute import head_compute_dtype, training_device
from specdecode.train.config import TrainConfig
from specdecode.train.feature_store import INDEX, FeatureStore, store_key
from specdecode.train.target_pass import NO_ARGMAX, PADDING, row_groups, run_target, run_targets
from specdecode.train.trainer import train


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("store_target"), "qwen2")


def _key(layers: tuple[int, ...] = (0, 2, 3)) -> dict[str, object]:
    return store_key("m", "cpu", None, "bfloat16", layers, 96, "dataset", 40)


def _sequences(model_dir: Path, count: int) -> list[tuple[list[int], int]]:
    prompts = chat_prompts(model_dir, examples(count, 500))
    ids = [p["prompt_token_ids"] for p in prompts]
    return [([*x, 7, 8, 9, 10 + i], len(x)) for i, x in enumerate(ids)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_stored_passes_read_back_bit_identical_to_a_fresh_pass(
    model_dir: Path, tmp_path: Path, dtype: str
) -> None:
    llm = LLM(str(model_dir), dtype=dtype)
    layers = (0, 2, 3)
    seqs = _sequences(model_dir, 5)
    store = FeatureStore(tmp_path / "s", _key(layers), shard_tokens=40)  # a shard per ~2
    for index, (ids, n) in enumerate(seqs):
        store.put(10 + index, run_target(llm.model, ids, n, layers))
    store.flush()
    again = FeatureStore(tmp_path / "s", _key(layers))  # a later run opens the folder
    assert len(again) == 5 and again.indices() == [10, 11, 12, 13, 14]
    assert len(json.loads((tmp_path / "s" / INDEX).read_text())["shards"]) >= 2
    for index, (ids, n) in enumerate(seqs):
        fresh = run_target(llm.model, ids, n, layers)
        read = again.get(10 + index)
        assert read.tokens.tolist() == ids and read.prompt_length == n
        assert read.layers == layers and read.states.dtype == fresh.states.dtype
        assert torch.equal(read.states, fresh.states) and torch.equal(read.argmax, fresh.argmax)
        assert (read.argmax[: n - 1] == NO_ARGMAX).all() and (read.argmax[n - 1 :] >= 0).all()
    # a head's own layers, in its order, are the stored columns
    width = llm.model.config.hidden_size
    p = again.get(10)
    assert torch.equal(p.at((3, 0)), torch.cat([p.states[:, 2 * width :], p.states[:, :width]], 1))
    with pytest.raises(ValueError, match="not among"):
        p.at((1,))


def test_the_full_state_of_a_pass_gives_the_targets_logits(model_dir: Path) -> None:
    """Layer L (the block count) is the final-normed state: the teacher's input."""
    llm = LLM(str(model_dir), dtype="float32")
    [(ids, n)] = _sequences(model_dir, 1)
    final = llm.model.config.num_layers
    p = run_target(llm.model, ids, n, (final,))
    logits = p.states @ llm.model.lm_head.weight.T.float()  # tied or not: the output rows
    assert torch.equal(logits[n - 1 :].argmax(-1), p.argmax[n - 1 :])


@pytest.mark.parametrize(("quantization", "dtype"), [("int8", "bfloat16"), (None, "float32")])
def test_sequences_run_as_rows_of_one_pass_give_their_own_passes(
    model_dir: Path, quantization: str | None, dtype: str
) -> None:
    """Training runs a batch's new sequences as right-padded rows of a few passes: each
    sequence's pass is the one it gets alone, bit for bit in the format CPU training uses
    (int8 weights, bf16 activations: row-exact kernels) and to float error in fp32."""
    llm = LLM(str(model_dir), dtype=dtype, quantization=quantization)
    layers = (0, 2, 3)
    seqs = _sequences(model_dir, 6)
    seqs[1] = (seqs[1][0] + list(range(20, 26)), seqs[1][1])  # lengths that need padding
    groups = row_groups([len(ids) for ids, _ in seqs], 4)
    assert max(len(g) for g in groups) > 1  # some sequences do share a pass
    together = run_targets(llm.model, seqs, layers, rows=4)
    for (ids, n), got in zip(seqs, together, strict=True):
        alone = run_target(llm.model, ids, n, layers)
        assert got.tokens.tolist() == ids and got.prompt_length == n and got.layers == layers
        assert torch.equal(got.argmax, alone.argmax)
        if quantization == "int8":
            assert torch.equal(got.states, alone.states)
        else:
            torch.testing.assert_close(got.states, alone.states, rtol=1e-5, atol=1e-5)


def test_row_groups_bound_rows_and_padding() -> None:
    assert row_groups([5, 100, 96], 4) == [[1, 2], [0]]
    assert row_groups([7, 7, 7], 1) == [[0], [1], [2]]
    lengths = [30 + (i * 37) % 200 for i in range(40)]
    groups = row_groups(lengths, 8)
    assert sorted(i for g in groups for i in g) == list(range(40))
    for g in groups:
        width, real = max(lengths[i] for i in g), sum(lengths[i] for i in g)
        assert len(g) <= 8 and width * len(g) <= (1 + PADDING) * real
    assert max(len(g) for g in groups) == 8
    with pytest.raises(ValueError, match="rows"):
        run_targets(None, [], (0,), rows=0)  # type: ignore[arg-type]


def test_a_store_of_other_passes_or_other_data_is_refused(model_dir: Path, tmp_path: Path) -> None:
    llm = LLM(str(model_dir), dtype="bfloat16")
    store = FeatureStore(tmp_path / "s", _key())
    [(ids, n)] = _sequences(model_dir, 1)
    store.put(0, run_target(llm.model, ids, n, (0, 2, 3)))
    with pytest.raises(ValueError, match="already stored"):
        store.put(0, run_target(llm.model, ids, n, (0, 2, 3)))
    with pytest.raises(ValueError, match="the store holds"):
        store.put(1, run_target(llm.model, ids, n, (0, 3)))
    store.flush()
    with pytest.raises(UserError, match="holds other passes"):
        FeatureStore(tmp_path / "s", _key((0, 3)))


def test_an_unflushed_shard_is_lost_and_the_rest_is_found(model_dir: Path, tmp_path: Path) -> None:
    llm = LLM(str(model_dir), dtype="bfloat16")
    store = FeatureStore(tmp_path / "s", _key(), shard_tokens=10**6)
    seqs = _sequences(model_dir, 3)
    store.put(0, run_target(llm.model, *seqs[0], (0, 2, 3)))
    store.flush()
    store.put(1, run_target(llm.model, *seqs[1], (0, 2, 3)))
    assert 1 in store and len(store) == 2
    # the run stops here: example 1 was never written
    reopened = FeatureStore(tmp_path / "s", _key())
    assert reopened.indices() == [0] and 1 not in reopened
    assert not list((tmp_path / "s").glob("*.tmp"))


def test_a_second_run_reads_the_store_and_trains_the_same_head(
    model_dir: Path, tmp_path: Path
) -> None:
    """Other runs (here: the same one again, into another folder) read every pass from the
    store: no target pass runs, and the head is the same, bit for bit."""
    features = tmp_path / "features"
    first = train_config(model_dir, tmp_path / "a", features=features, budget_examples=24)
    train(first, examples(60), examples(4, 1000), progress=False)
    second = train_config(model_dir, tmp_path / "b", features=features, budget_examples=24)
    train(second, examples(60), examples(4, 1000), progress=False)
    logs = [json.loads((tmp_path / d / "train_log.json").read_text()) for d in "ab"]
    assert logs[0]["summary"]["passes_run"] == 24 and logs[1]["summary"]["passes_run"] == 0
    weights = [(tmp_path / d / "model.safetensors").read_bytes() for d in "ab"]
    assert weights[0] == weights[1]


def test_later_epochs_read_the_store_and_resume_exactly(model_dir: Path, tmp_path: Path) -> None:
    """Three epochs over 16 examples: the target runs once per example; a run stopped during
    epoch 2 (its checkpoint, then --resume) ends with the same head as one run."""
    whole = train_config(
        model_dir, tmp_path / "whole", budget_examples=16, epochs=3, checkpoint_minutes=1e-9
    )
    state = train(whole, examples(60), examples(4, 1000), progress=False)
    log = json.loads((tmp_path / "whole" / "train_log.json").read_text())
    assert log["summary"]["passes_run"] == 16 and log["summary"]["epoch"] == 2
    assert state.step == 12  # 4 steps of 4 examples per epoch
    # the same run stopped at step 9 (epoch 2, after its first batch) and resumed
    part = tmp_path / "part"
    cut = train_config(model_dir, part, budget_examples=16, epochs=3)
    stopped = _stop_after(cut, steps=9)
    assert (stopped.epoch, stopped.position) == (2, 1)
    train(
        train_config(model_dir, part, budget_examples=16, epochs=3, resume=True),
        examples(60),
        examples(4, 1000),
        progress=False,
    )
    assert (part / "model.safetensors").read_bytes() == (
        tmp_path / "whole" / "model.safetensors"
    ).read_bytes()


def _stop_after(config: TrainConfig, steps: int) -> TrainState:
    """Train `config` and stop it at its checkpoint after `steps` steps (as a killed run)."""
    from specdecode.train import trainer

    real = trainer._optimizer_step
    calls = {"n": 0}

    class Stopped(Exception):
        pass

    def step(*args: object, **kw: object) -> float:
        if calls["n"] == steps:
            raise Stopped
        calls["n"] += 1
        return real(*args, **kw)

    trainer._optimizer_step = step
    try:
        train(
            dataclasses.replace(config, checkpoint_minutes=1e-9),
            examples(60),
            examples(4, 1000),
            progress=False,
        )
    except Stopped:
        pass
    finally:
        trainer._optimizer_step = real
    saved = torch.load(config.out / "checkpoint.pt", weights_only=False)
    return TrainState(**saved["state"])


def test_epochs_need_an_example_budget_and_devices_are_checked(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="give --quantization none"):
        TrainConfig(model="x", out=tmp_path, device="cuda", quantization="int8")
    with pytest.raises(UserError, match="--epochs > 1"):
        TrainConfig(model="x", out=tmp_path, epochs=2)
    with pytest.raises(UserError, match="unknown device"):
        training_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA GPU"):
            training_device("cuda")
    assert head_compute_dtype("auto", frozenset(), torch.device("cuda")) == torch.bfloat16
    assert head_compute_dtype("float32", frozenset(), torch.device("cuda")) == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_head_trains_on_a_gpu_like_on_the_cpu(model_dir: Path, tmp_path: Path) -> None:
    """The target and the head on CUDA (fp32 matmuls, to compare): the same losses as on the
    CPU, to float tolerance; then the GPU's own default (bf16 autocast) learns too."""
    logs = []
    for device, dtype in (("cpu", "float32"), ("cuda", "float32"), ("cuda", "auto")):
        out = tmp_path / f"{device}-{dtype}"
        config = train_config(model_dir, out, device=device, head_dtype=dtype)
        train(config, examples(200), examples(4, 1000), progress=False)
        logs.append(json.loads((out / "train_log.json").read_text()))
    cpu, gpu, bf16 = (log["history"] for log in logs)
    assert logs[2]["summary"]["head_dtype"] == "bfloat16"
    assert bf16[-1]["loss"] < bf16[0]["loss"] - 0.5
    assert [h["step"] for h in cpu] == [h["step"] for h in gpu]
    for a, b in zip(cpu, gpu, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3, abs=1e-3)
    assert gpu[-1]["loss"] < gpu[0]["loss"] - 0.5


def test_later_epochs_batch_similar_lengths_in_a_shuffled_order() -> None:
    lengths = {i: (i * 37) % 101 + 10 for i in range(0, 200, 2)}  # 100 examples
    batches = epoch_batches(lengths, seed=0, epoch=1, batch_size=4)
    assert sorted(i for b in batches for i in b) == sorted(lengths)  # each once
    assert epoch_batches(lengths, seed=0, epoch=1, batch_size=4) == batches  # a resume finds it
    assert epoch_batches(lengths, seed=0, epoch=2, batch_size=4) != batches
    spread = [max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches]
    assert sum(spread) / len(spread) < 15  # random batches of 4 from 10..110 spread ~60
    firsts = [lengths[b[0]] for b in batches]
    assert firsts != sorted(firsts)  # not a length curriculum
