"""Training modes (`ldm.adapters`): LatentDiffusion holds one and calls its hooks.

Full fine-tuning (no `lora:`) trains every weight Lightning would (the backbone, and a trainable
conditioner) in one group and rewrites nothing; a LoRA run trains only its adapters, the text
encoder's at their own rate when `text_encoder.lr` is set (kohya's `--text_encoder_lr`:
sd-scripts' `prepare_optimizer_params` puts the text encoder's LoRA modules in a group of their
own with that lr).
"""

from ldm.adapters import FullFineTune
from ldm.layout.peft import is_adapter_name
from ldm.lora.mode import LoraMode
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container

LR = 1.0e-4


def build(tiny_config, *dotlist):
    overrides = [f"model.params.learning_rate={LR}", *dotlist]
    return instantiate_from_config(to_container(merge_configs([tiny_config], overrides))["model"])


def ids(params) -> set[int]:
    return {id(p) for p in params}


def test_full_fine_tuning_trains_every_backbone_weight_in_one_group(tiny_config):
    model = build(tiny_config)
    assert type(model.training_mode) is FullFineTune and model.lora_settings is None
    [group] = model.configure_optimizers().param_groups
    assert group["lr"] == LR
    assert ids(group["params"]) == ids(model.model.parameters())  # the whole backbone
    ckpt = {"state_dict": dict(model.state_dict())}
    model.on_save_checkpoint(ckpt)
    assert list(ckpt["state_dict"]) == list(model.state_dict())  # the module's own names


def test_the_text_encoders_adapters_train_at_their_own_rate(tiny_config):
    model = build(tiny_config, "model.params.lora={rank: 2, text_encoder: {rank: 2, lr: 3.0e-5}}")
    assert isinstance(model.training_mode, LoraMode)
    unet, text = model.configure_optimizers().param_groups
    assert (unet["lr"], text["lr"]) == (LR, 3.0e-5)
    adapters = {n: p for n, p in model.named_parameters() if is_adapter_name(n)}
    unet_adapters = [p for n, p in adapters.items() if n.startswith("model.")]
    text_adapters = [p for n, p in adapters.items() if not n.startswith("model.")]
    assert unet_adapters and text_adapters
    assert ids(unet["params"]) == ids(unet_adapters)
    assert ids(text["params"]) == ids(text_adapters)


def test_without_a_text_lr_all_adapters_share_the_models_rate(tiny_config):
    model = build(tiny_config, "model.params.lora={rank: 2, text_encoder: {rank: 2}}")
    [group] = model.configure_optimizers().param_groups
    adapters = [p for n, p in model.named_parameters() if is_adapter_name(n)]
    assert group["lr"] == LR and ids(group["params"]) == ids(adapters)
