"""Strategies, precision and training options: the presets under configs/lightning/, run for
real on CPU with 2 processes (DDP, DeepSpeed ZeRO-2/3, FSDP), gradient accumulation, and the
options that must not change the loss (gradient checkpointing, channels_last, torch.compile)."""

import importlib.util
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.strategies import DDPStrategy
from run_helpers import failure_lines, free_ports, start_main
from safetensors.torch import load_file
from strategy_checks import one_step, tiny_model
from torch.testing import assert_close

import lun.strategies
from ldm.checkpoint import load_weights
from ldm.layout.ema import ema_key
from ldm.util import instantiate_from_config
from lun.config import ConfigError, merge_configs, to_container
from lun.run import RunDir
from lun.strategies import DeepSpeedStrategy, FSDPStrategy, build_strategy
from lun.trainer import build_trainer, trainer_kwargs

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ROOT / "configs" / "lightning"
TINY = ROOT / "configs" / "tiny" / "ldm.yaml"
ON_CPU_WITH_2 = ["lightning.trainer.accelerator=cpu", "lightning.trainer.devices=2"]


@pytest.mark.parametrize(
    "config, cls, stage",
    [
        ("deepspeed", DeepSpeedStrategy, 2),
        ("deepspeed_stage_3_offload", DeepSpeedStrategy, 3),
        (
            {"target": "lightning.pytorch.strategies.DeepSpeedStrategy", "params": {"stage": 1}},
            DeepSpeedStrategy,
            1,
        ),
        ("fsdp", FSDPStrategy, None),
        ("fsdp_native", FSDPStrategy, None),
        ({"target": "lightning.pytorch.strategies.FSDPStrategy"}, FSDPStrategy, None),
    ],
)
def test_deepspeed_and_fsdp_names_become_the_adapters(config, cls, stage):
    strategy = build_strategy(config)
    assert type(strategy) is cls
    if stage is not None:
        assert strategy.config["zero_optimization"]["stage"] == stage


def test_other_names_go_to_lightning_unchanged():
    assert build_strategy("ddp") == "ddp"
    strategy = build_strategy({"target": "lightning.pytorch.strategies.DDPStrategy", "params": {}})
    assert type(strategy) is DDPStrategy


def test_missing_deepspeed_is_a_config_error_naming_pip(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "deepspeed" else real_find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match=r"lightning.strategy: .*pip install deepspeed"):
        trainer_kwargs({"strategy": "deepspeed_stage_2"})
    with pytest.raises(ConfigError, match="pip install deepspeed"):
        trainer_kwargs({"trainer": {"strategy": "deepspeed_stage_3"}})


@pytest.mark.parametrize(
    "preset, cls",
    [
        ("ddp", DDPStrategy),
        ("deepspeed_stage2", DeepSpeedStrategy),
        ("deepspeed_stage3", DeepSpeedStrategy),
        ("fsdp", FSDPStrategy),
    ],
)
def test_every_preset_merges_and_builds_a_trainer(tmp_path, preset, cls):
    cfg = merge_configs([TINY, PRESETS / f"{preset}.yaml"], ON_CPU_WITH_2)
    trainer = build_trainer(to_container(cfg)["lightning"], RunDir(tmp_path), has_validation=False)
    assert type(trainer.strategy) is cls
    assert trainer.num_devices == 2 and trainer.max_steps == 2  # the tiny config's value survives
    assert trainer._accelerator_connector.use_distributed_sampler is False


def test_stage2_preset_offloads_the_optimizer_with_a_torch_optimizer(tmp_path):
    cfg = merge_configs([TINY, PRESETS / "deepspeed_stage2.yaml"], ON_CPU_WITH_2)
    strategy = build_trainer(to_container(cfg)["lightning"], RunDir(tmp_path), False).strategy
    assert strategy.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert strategy.config["zero_force_ds_cpu_optimizer"] is False


@pytest.fixture(scope="module")
def baseline_step():
    """One optimizer step over the 4 samples as one batch, fp32, no options: the reference."""
    return one_step(batch_size=4, accumulate=1)


def test_accumulate_2_x_batch_2_makes_the_same_step_as_batch_4(baseline_step):
    """Same update (plain SGD: -lr x gradient) and the same logged loss, per optimizer step."""
    update_4, loss_4 = baseline_step
    update_2x2, loss_2x2 = one_step(batch_size=2, accumulate=2)
    assert loss_2x2 == pytest.approx(loss_4, rel=1e-6)  # the loss of all 4 samples, not the last 2
    assert any(u.abs().max() > 1e-3 for u in update_4.values())  # a real step was taken
    for name, update in update_4.items():
        assert_close(update_2x2[name], update, rtol=1e-4, atol=1e-7)


# DeepSpeed's accumulation (its engine divided the loss a second time) is checked on 2 processes
# with the other strategies' numbers: tests/lun/test_strategy_numbers.py.


@pytest.mark.parametrize(
    "option",
    [
        {"unet_params": {"use_checkpoint": True}},
        {"channels_last": True},
        # Dynamo captures the UNet's graph; the "eager" backend runs it without code generation
        # (inductor's C++ build takes minutes on 2 CPU cores; `compile_unet: true` uses it).
        pytest.param({"compile_unet": {"backend": "eager"}}, marks=pytest.mark.slow),
    ],
    ids=["gradient_checkpointing", "channels_last", "compile"],
)
def test_training_options_make_the_same_step(baseline_step, option):
    update, loss = baseline_step
    update_with, loss_with = one_step(batch_size=4, accumulate=1, **option)
    assert loss_with == pytest.approx(loss, rel=1e-5)
    for name in update:
        assert_close(update_with[name], update[name], rtol=1e-4, atol=1e-6)


def test_options_are_applied_to_the_unet():
    model = tiny_model(channels_last=True, compile_unet={"backend": "eager"})
    unet = model.model.diffusion_model
    conv = unet.input_blocks[0][0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    assert unet._compiled_call_impl is not None
    assert "model.diffusion_model.input_blocks.0.0.weight" in model.state_dict()  # names unchanged


@pytest.mark.parametrize("fp32", [True, False])
def test_vae_stays_float32_under_mixed_precision_when_asked(fp32):
    model = tiny_model(first_stage_fp32=fp32)
    seen = []
    model.first_stage_model.encoder.conv_in.register_forward_hook(
        lambda m, i, out: seen.append(out.dtype)
    )
    images = torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        latents = model.encode_first_stage(images, torch.Generator().manual_seed(0))
        eps = model.apply_model(
            latents, torch.tensor([10, 500]), model.conditioning({"caption": ["a", "b"]})
        )
    expected = torch.float32 if fp32 else torch.bfloat16
    assert seen == [expected] and latents.dtype == expected
    assert eps.dtype == torch.bfloat16  # the UNet runs in bf16 either way


def test_bf16_mixed_trains_close_to_fp32(baseline_step):
    _, loss = baseline_step
    update, loss_bf16 = one_step(batch_size=4, accumulate=1, precision="bf16-mixed")
    assert loss_bf16 == pytest.approx(loss, rel=2e-2)
    assert all(torch.isfinite(u).all() for u in update.values())


# --- end to end: 2 processes on CPU, checkpoint, resume, EMA, one exported file ----------------


def training_args(shapes_dir: Path, logs: Path) -> list[str]:
    return [
        f"data.params.train.params.data_root={shapes_dir}",
        "-l",
        str(logs),
        "-n",
        "run",
        "model.params.use_ema=true",
        # decay 0: the average is the weights, so it must equal the merged weights
        "lightning.callbacks.ema.params={decay: 0.0, warmup: none}",
        # The text encoder trains too, as in configs/demo/shapes.yaml: its weights must survive
        # every strategy's save (FSDP once asserted on a frozen encoder's missing token_embedding).
        "model.params.cond_stage_trainable=true",
    ]


TEXT_ENCODER = "cond_stage_model.transformer.text_model."


def check_written(saved: dict, step: int) -> None:
    """A run's last.ckpt (a file or a strategy's folder, as `load_training_checkpoint` reads
    it) holds `step` and the text encoder."""
    assert saved["global_step"] == step
    assert any(k.startswith(TEXT_ENCODER + "encoder.layers.") for k in saved["state_dict"])


def resume_args(run: Path, *overrides: str) -> list[str]:
    """Resume the 2-step run to step 3."""
    return ["-r", str(run), "lightning.trainer.max_steps=3", *overrides, "-t"]


def check_resumed_and_export(tmp_path: Path, run: Path, ema_exact: bool = True) -> None:
    """The run resumed to step 3 (`resume_args`); export it as one original-layout file."""
    import convert

    last = run / "checkpoints" / "last.ckpt"
    merged = lun.strategies.load_training_checkpoint(last)
    state = merged["state_dict"]
    assert merged["global_step"] == 3  # resumed at 2, not from 0
    assert int(state["model_ema.num_updates"]) == 3
    unet = [k.removeprefix("model.") for k in state if k.startswith("model.")]
    assert unet
    for name in unet:  # the average is of the full (gathered) weights
        tolerance = {"rtol": 0, "atol": 0} if ema_exact else {"rtol": 1e-2, "atol": 1e-3}
        assert_close(state[ema_key(name)], state["model." + name], **tolerance)

    out = tmp_path / "model.safetensors"
    convert.main([str(last), str(out), "--ema"])
    assert list(tmp_path.glob("*.safetensors")) == [out]
    exported = load_file(str(out))
    seed_everything(23)  # main.py's default seed: the weights the run started from
    start = instantiate_from_config(to_container(merge_configs([TINY]))["model"]).state_dict()
    assert exported.keys() == start.keys()  # original layout, weights only
    text_encoder = [k for k in exported if k.startswith(TEXT_ENCODER)]
    assert any(k.startswith(TEXT_ENCODER + "embeddings.token_embedding.") for k in text_encoder)
    for key, value in exported.items():
        if key.startswith(("first_stage_model.", "cond_stage_model.")):
            assert value.dtype == torch.float32, key
        if key.startswith("first_stage_model."):  # frozen: exact
            assert torch.equal(value, start[key]), key
    assert any(not torch.equal(exported["model." + n], start["model." + n]) for n in unet)
    # trained (cond_stage_trainable), and saved as trained
    assert any(not torch.equal(exported[k], start[k]) for k in text_encoder)
    assert all(torch.equal(exported[k], state[k].float()) for k in text_encoder)
    load_weights(instantiate_from_config(to_container(merge_configs([TINY]))["model"]), out)


def train_then_resume(
    tmp_path: Path, args: list[str], resume_overrides: list[str], port: int, launched: list
) -> dict:
    """main.py ARGS (2 steps) on rendezvous port `port`, its checkpoint read, then its resume
    to step 3 (on a port picked then: one held unused a minute could be taken meanwhile): what
    the test checks, by phase. Stops at the first launch that fails."""
    first = start_main(args, tmp_path, tmp_path / "stderr.txt", port)
    launched.append(first)
    phases = {"first": first.wait(timeout=600)}
    if phases["first"] != 0:
        return phases
    (run,) = (tmp_path / "logs").iterdir()
    # Read before the resume writes last.ckpt again.
    phases["written"] = lun.strategies.load_training_checkpoint(run / "checkpoints" / "last.ckpt")
    (port,) = free_ports(1)
    resumed = start_main(
        resume_args(run, *resume_overrides), tmp_path, tmp_path / "resumed.txt", port
    )
    launched.append(resumed)
    phases["resumed"], phases["run"] = resumed.wait(timeout=600), run
    return phases


TWO_NODES_TEST = "test_ddp_on_two_nodes_under_torchrun"


@pytest.fixture(scope="module")
def chains(request, tmp_path_factory, shapes_dir):
    """Each (preset, precision) this session's tests ask for: its 2-step 2-process run, then
    its resume to step 3 (`train_then_resume`); and the two "nodes" of `two_nodes` when its test
    runs. All side by side in threads of this process: a launch leaves a core idle much of its
    start-up (rank 1 starts once rank 0 is set up), so they fill each other's idle time, each
    with a rendezvous port of its own. (preset, precision) or "two_nodes" -> (its folder, the
    future of what it returns)"""
    mine = [item for item in request.session.items if item.module is request.module]
    wanted = [
        item.callspec.params
        for item in mine
        if item.originalname == "test_two_processes_train_resume_and_export_one_file"
    ]
    with_two_nodes = any(item.originalname == TWO_NODES_TEST for item in mine)
    ports = free_ports(len(wanted) + 1)
    launched = []  # every process started, for the clean-up
    chains = {}
    with ThreadPoolExecutor(max_workers=len(wanted) + 1) as pool:
        for i, params in enumerate(wanted):
            preset, precision = params["preset"], params["precision"]
            tmp_path = tmp_path_factory.mktemp(f"{preset}-{precision}")
            args = [
                "--base",
                str(TINY),
                str(PRESETS / f"{preset}.yaml"),
                *ON_CPU_WITH_2,
                f"lightning.trainer.precision={precision}",
                *training_args(shapes_dir, tmp_path / "logs"),
                "-t",
            ]
            chain = pool.submit(
                train_then_resume,
                tmp_path,
                args,
                params["resume_overrides"],
                ports[i],
                launched,
            )
            chains[preset, precision] = (tmp_path, chain)
        if with_two_nodes:
            tmp_path = tmp_path_factory.mktemp("two_nodes")
            nodes = pool.submit(two_nodes, tmp_path, shapes_dir, ports[-1], launched)
            chains["two_nodes"] = (tmp_path, nodes)
        try:
            yield chains
        finally:  # a test that failed first leaves no run going
            for process in launched:
                process.kill()
                process.wait()


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset, precision, resume_overrides",
    [
        ("deepspeed_stage2", "bf16-mixed", []),
        ("deepspeed_stage3", "32-true", []),
        # Resumed from the full file it wrote, the run then saves a folder of shards at step 3.
        ("fsdp", "bf16-mixed", ["lightning.strategy.params.state_dict_type=sharded"]),
    ],
)
def test_two_processes_train_resume_and_export_one_file(
    chains, preset, precision, resume_overrides
):
    tmp_path, chain = chains[preset, precision]  # main.py with "{preset}.yaml", then -r
    phases = chain.result(timeout=1200)
    assert phases["first"] == 0, failure_lines((tmp_path / "stderr.txt").read_text())
    check_written(phases["written"], step=2)
    resumed_stderr = (tmp_path / "resumed.txt").read_text()
    assert phases["resumed"] == 0, failure_lines(resumed_stderr)
    assert "average restarts" not in resumed_stderr  # the EMA came back from the checkpoint
    # DeepSpeed's 16-bit mode trains 16-bit weights (float32 masters in the optimizer): the EMA
    # averages those. FSDP's and DDP's mixed precision keep float32 weights.
    ema_exact = not (preset.startswith("deepspeed") and "16" in precision)
    check_resumed_and_export(tmp_path, phases["run"], ema_exact=ema_exact)
    if resume_overrides:
        assert (phases["run"] / "checkpoints" / "last.ckpt" / ".metadata").is_file()  # shards


def two_nodes(tmp_path: Path, shapes_dir: Path, port: int, launched: list) -> list:
    """`torchrun --nnodes 2`: two launches, one per "node", meeting at a rendezvous on
    localhost at `port`, each training on one process. (returncode, stdout, stderr) of each."""
    args = [
        "--base",
        str(TINY),
        str(PRESETS / "ddp.yaml"),
        "lightning.trainer.accelerator=cpu",
        "lightning.trainer.devices=1",
        "lightning.trainer.num_nodes=2",
        *training_args(shapes_dir, tmp_path / "logs"),
        "-t",
    ]
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(rank),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                str(ROOT / "main.py"),
                *args,
            ],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    launched.extend(nodes)
    outputs = [node.communicate(timeout=600) for node in nodes]
    return [(node.returncode, out, err) for node, (out, err) in zip(nodes, outputs, strict=True)]


@pytest.mark.slow
def test_ddp_on_two_nodes_under_torchrun(chains):
    """`torchrun --nnodes 2` (`two_nodes`): the two nodes meet, and rank 0 writes the run. (A DDP
    checkpoint is one plain file: its exact 2-process resume is tests/e2e/test_resume.py's, its
    export scripts/convert.py's tests'.)"""
    tmp_path, launch = chains["two_nodes"]
    nodes = launch.result(timeout=1200)
    for returncode, _, err in nodes:
        assert returncode == 0, err[-3000:]
    both = "".join(err for _, _, err in nodes)
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in both and "GLOBAL_RANK: 1, MEMBER: 2/2" in both
    # Only global rank 0 plans and makes the run folder: node 1's first process is local rank 0
    # too, and must not take itself for the run's first (lun.run.is_rank_zero reads RANK).
    assert ["memory plan:" in out for _, out, _ in nodes] == [True, False]
    logs = tmp_path / "logs"
    assert len(list(logs.iterdir())) == 1
    runs = [run for run in logs.iterdir() if (run / "checkpoints" / "last.ckpt").exists()]
    assert len(runs) == 1  # rank 0 writes
    check_written(lun.strategies.load_training_checkpoint(runs[0] / "checkpoints" / "last.ckpt"), 2)


def test_strategy_kind_names_each_engine_by_lightnings_classes():
    """The one place strategies are told apart by class (issue 31): Lightning's own classes and
    our adapters (subclasses) by engine; a name is not a strategy yet."""
    from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeed
    from lightning.pytorch.strategies import FSDPStrategy as LightningFSDP
    from lightning.pytorch.strategies import ModelParallelStrategy, SingleDeviceStrategy

    from lun.strategies import find_unused_parameters, strategy_kind

    assert strategy_kind(FSDPStrategy()) == strategy_kind(LightningFSDP()) == "fsdp"
    assert strategy_kind(DDPStrategy()) == "ddp"
    assert strategy_kind(ModelParallelStrategy()) == "model_parallel"
    assert strategy_kind(SingleDeviceStrategy("cpu")) == strategy_kind("ddp") == "single"
    if importlib.util.find_spec("deepspeed"):
        assert strategy_kind(DeepSpeedStrategy(stage=2)) == "deepspeed"
        assert strategy_kind(LightningDeepSpeed(stage=2)) == "deepspeed"
    assert find_unused_parameters(DDPStrategy(find_unused_parameters=True))
    assert not find_unused_parameters(DDPStrategy())
    assert not find_unused_parameters(FSDPStrategy())


# DeepSpeed's engine casts the module's parameters to its fp16 / bf16 itself, and FSDP flattens
# each unit's parameters into one FlatParameter of one dtype (torch: "Must flatten tensors with
# uniform dtype"), cast by its MixedPrecision; DDP and one device keep the module as it is.
CASTS_PARAMETERS = {"fsdp": True, "deepspeed_stage_2": True, "ddp": False}


@pytest.mark.parametrize("name", sorted(CASTS_PARAMETERS))
def test_a_lora_base_is_left_to_a_strategy_that_casts_parameters(tiny_config, name):
    """From the strategy through lun (`check_strategy_fits`, before fit) to the module's training
    mode at fit start: under bf16-mixed a LoRA run holds its frozen base in bf16, unless the
    strategy casts the parameters itself (`base_dtype: auto`)."""
    from lightning.pytorch import Trainer
    from lora_helpers import build

    from ldm import lora
    from lun.run import check_strategy_fits

    if name.startswith("deepspeed") and not importlib.util.find_spec("deepspeed"):
        pytest.skip("deepspeed is not installed")
    model = build(tiny_config, "{rank: 2}")
    strategy = build_strategy(name)
    check_strategy_fits(model, strategy)
    assert lun.strategies.casts_parameters(strategy) is CASTS_PARAMETERS[name]
    model.trainer = Trainer(
        accelerator="cpu", precision="bf16-mixed", logger=False, enable_checkpointing=False
    )
    model.setup("fit")
    layer = lora.adapter_layers(model)[
        "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q"
    ]
    expected = torch.float32 if CASTS_PARAMETERS[name] else torch.bfloat16
    assert layer.base_layer.weight.dtype == expected
    assert layer.lora_A["default"].weight.dtype == torch.float32  # the adapters train in fp32
