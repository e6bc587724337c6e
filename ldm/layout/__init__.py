"""The weights layout: which names a checkpoint's tensors carry, and how other layouts map to ours.

Every key prefix is spelled here and nowhere else (pinned by tests/ldm/test_layout_rules.py):

- `family`: `model_family(keys | state dict | model | config)`, the one question every loader
  and script asks before loading, and the one-line names of families and files.
- `original`: the CompVis / sgm single-file names our modules carry (backbone, VAE, text towers).
- `ema`: LitEma's `model_ema.*` shadows. `wrappers`: the levels torch.compile / FSDP /
  checkpointing add, Lightning's sharded checkpoints. `peft`: LoRA runs' adapter keys.
- `dit`: DiT's bare backbone files and diffusers' DiT names. `diffusers`: diffusers pipeline
  folders read in the original layout. `diffusers_vae`: diffusers' AutoencoderKL names.
  `kohya`: kohya-ss / diffusers LoRA file names and metadata.

Files are read by `ldm.safe_load` (below this package); `ldm.checkpoint` (above it) loads them
into models. Nothing here imports `ldm.checkpoint` or a model module: the only model built here
is `model_family(config)`'s, on the meta device, through the config's own target.
"""
