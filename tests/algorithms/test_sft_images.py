"""SFT with images end to end on the fake 8-device mesh: JSONL records with drawn images (a red or a blue square, the
reply its colour) through the real pipeline and the SFT job's step, the random SigLIP tower frozen. The loss falls, the
image decides the reply on held-out images, image tokens never train, and the tower gets no gradient and no update."""

import base64
import dataclasses
import io
import json

import jax
import numpy as np
import pytest
from image_vocab import image_vocab
from PIL import Image

from ptx.algorithms import sft
from ptx.config import Config, ConfigError, DataConfig, MeshConfig, OptimizerConfig, TrainConfig
from ptx.data.batch import pack_rows
from ptx.data.global_batch import to_global
from ptx.data.hf_tokenizer import HFTokenizer
from ptx.data.image_tokens import FAKE_AROUND_IMAGE, GLOBAL_IMAGE, image_token_id
from ptx.data.images import image_config
from ptx.data.pipeline import make_pipeline
from ptx.data.records import RecordError, encode
from ptx.data.sources import MemorySource, NoDataError
from ptx.data.tokenizer import ByteTokenizer
from ptx.model_config import ModelConfig, VisionConfig
from ptx.models import vision
from ptx.models.chunked_logits import token_stats
from ptx.sharding import make_mesh
from ptx.train import streams
from ptx.train.job import sft_job
from ptx.train.state import init_state, state_shardings

TOK = HFTokenizer(image_vocab(), eos_token="<|endoftext|>")
# 16-pixel images of 4-pixel patches (16 patches of 48 values), one encoder layer of width 24 (2 heads, MLP 40),
# 2 x 2 shuffle: 4 image tokens a tile; the text model of d_model 40 over the 400-id image vocabulary. Heads, MLPs and
# the vocabulary divide tensor=2, widths fsdp=2.
VISION = VisionConfig(depth=1, image_size=16, patch_size=4, width=24, n_heads=2, mlp_dim=40, scale_factor=2,
                      image_token_id=image_token_id(TOK))
MODEL = ModelConfig(vocab_size=400, d_model=40, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=14, mlp_dim=96,
                    init_std=0.1, vision=VISION)
COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220)}
STEPS = 30


def _png(colour: str, seed: int) -> str:
  """A 16-pixel square image, white, with a square of `colour` somewhere in it: base64 PNG."""
  rng = np.random.default_rng(seed)
  pixels = np.full((16, 16, 3), 255, np.uint8)
  side = int(rng.integers(6, 11))
  top, left = rng.integers(0, 17 - side, 2)
  pixels[top:top + side, left:left + side] = COLOURS[colour]
  out = io.BytesIO()
  Image.fromarray(pixels).save(out, "PNG")
  return base64.b64encode(out.getvalue()).decode()


def _record(colour: str, seed: int, reply: str | None = None) -> dict:
  return {"messages": [
      {"role": "user", "content": [{"type": "image", "bytes": _png(colour, seed)},
                                   {"type": "text", "text": "What colour is the square?"}]},
      {"role": "assistant", "content": reply or colour}]}


def _config(tmp_path, **data) -> Config:
  path = tmp_path / "colours.jsonl"
  path.write_text("".join(json.dumps(_record(c, seed)) + "\n" for seed in range(8) for c in COLOURS))
  return Config(model=MODEL, mesh=MeshConfig(data=2, fsdp=2, tensor=2),
                optim=OptimizerConfig(lr=1e-2, warmup_steps=0), train=TrainConfig(steps=STEPS),
                data=DataConfig(train_files=(str(path),), batch_size=4, seq_len=128, tiles_per_row=2,
                                **{"image_tiles_per_edge": 1, "num_threads": 1, "prefetch": 8, **data}))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """The SFT job of `_config` trained for STEPS steps on the pipeline's batches: (config, job, mesh, state before,
  state after, losses, the first batch)."""
  tmp = tmp_path_factory.mktemp("sft_images")
  cfg = _config(tmp)
  job = sft_job(cfg, TOK)
  mesh = make_mesh(cfg.mesh)
  optimizer = job.optimizer()
  shardings = state_shardings(MODEL, optimizer, mesh, job.rules)
  state = init_state(MODEL, optimizer, cfg.train.seed, mesh, job.rules)
  first = jax.device_get(state)  # the step donates the state
  train, _ = streams.supervised(cfg, TOK, out=tmp)
  batches = iter(train)
  step = job.step.build(optimizer, mesh, shardings, batches)
  losses, first_batch = [], None
  for _ in range(STEPS):
    batch = next(batches)
    first_batch = first_batch or batch
    state, metrics = step(state, to_global(batch, mesh, job.rules))
    losses.append(float(metrics["loss"]))
  return cfg, job, mesh, first, state, losses, first_batch


@jax.jit
def _reply_logps(params, batch):
  """Sum of the log-probs of each row's target tokens (its reply), the images read as the SFT loss reads them."""
  images = vision.Images(vision.encode_images(params, batch["pixel_values"], MODEL), batch["image_slots"])
  stats, _ = token_stats(params, batch["tokens"], MODEL, positions=batch["positions"],
                         segment_ids=batch["segment_ids"], images=images)
  return (stats.log_probs[:, 1:] * sft.next_token_targets(batch)[1]).sum(1)


def test_the_loss_falls_and_the_image_decides_the_reply(run):
  cfg, job, mesh, _, state, losses, _ = run
  assert np.mean(losses[-5:]) < 0.2 * np.mean(losses[:3]), losses
  images = image_config(MODEL.vision, cfg.data)
  # Held-out squares (seeds the records do not use), each with both replies: one row per (image, reply).
  cases = [(colour, seed, reply) for seed in (100, 101) for colour in COLOURS for reply in COLOURS]
  rows = [[encode("sft", TOK, _record(colour, seed, reply), "held-out", images=images)]
          for colour, seed, reply in cases]
  batch = to_global(pack_rows(rows, cfg.data.seq_len, TOK.pad_id, cfg.data.tiles_per_row, images.tile_size), mesh,
                    job.rules)
  with jax.set_mesh(mesh):
    logps = np.asarray(_reply_logps(state.params, batch)).reshape(2, 2, 2)  # [seed, image colour, reply]
  # Each image's own colour is the likelier reply: the text model reads the frozen tower's features.
  assert (logps[:, 0, 0] > logps[:, 0, 1]).all() and (logps[:, 1, 1] > logps[:, 1, 0]).all(), logps


def test_image_tokens_never_enter_the_loss_through_the_pipeline(run):
  cfg = run[0]
  # Replies that show an image too: inside an assistant turn, where every other token trains.
  records = [{"messages": _record(colour, seed)["messages"][:1] + [
      {"role": "assistant", "content": [{"type": "text", "text": colour},
                                        {"type": "image", "bytes": _png(colour, 9)}]}]}
      for seed in range(4) for colour in COLOURS]
  pipeline = make_pipeline(MemorySource(records), TOK, cfg.data, images=image_config(MODEL.vision, cfg.data))
  batch = next(iter(pipeline))
  expansion = np.isin(batch["tokens"], TOK.encode(FAKE_AROUND_IMAGE + GLOBAL_IMAGE) + [VISION.image_token_id])
  assert expansion.any() and batch["loss_mask"].any()
  assert not (batch["loss_mask"] * expansion).any()
  # The slots number each row's image tokens in order: 4 a tile, a row's tiles (each record's two, a row one record
  # as its tile budget allows) after one another.
  assert ((batch["image_slots"] >= 0) == (batch["tokens"] == VISION.image_token_id)).all()
  for slots in batch["image_slots"]:
    np.testing.assert_array_equal(slots[slots >= 0], np.arange(2 * VISION.tokens_per_image))
  assert batch["pixel_values"].shape == (4, 2, 3, 16, 16) and batch["pixel_attention_mask"].all()
  # The first step's batch of the run, from the records of _config, holds the same layout.
  assert ((run[-1]["image_slots"] >= 0) == (run[-1]["tokens"] == VISION.image_token_id)).all()


def test_the_frozen_tower_takes_no_gradient_and_no_update(run):
  cfg, _, _, first, state, _, batch = run
  after = jax.device_get(state)
  for part in ("vision", "connector"):
    jax.tree.map(np.testing.assert_array_equal, after.params[part], first.params[part])
  moments = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(after.opt_state)
             if any(getattr(key, "key", None) in ("vision", "connector") for key in path)]
  assert moments and not any(np.asarray(m).any() for m in moments)  # Adam's moments of the tower stay 0
  assert not np.array_equal(after.params["embed"], first.params["embed"])
  # The features send no gradient into the tower or the connector unless model.vision.train_tower /
  # train_connector say so (the optimizer alone would zero it: grad_norm would count it, the backward pass run it).
  grads = {}
  for train_tower in (False, True):
    model = dataclasses.replace(MODEL, vision=dataclasses.replace(VISION, train_tower=train_tower))
    features = jax.jit(jax.grad(lambda p, x: vision.encode_images(p, x, model).sum()))
    grads[train_tower] = features(first.params, batch["pixel_values"])
  assert not any(np.asarray(g).any() for g in jax.tree.leaves((grads[False]["vision"], grads[False]["connector"])))
  assert all(np.asarray(g).any() for g in jax.tree.leaves(grads[True]["vision"]))
  assert not any(np.asarray(g).any() for g in jax.tree.leaves(grads[True]["connector"]))  # still frozen


def test_records_with_images_are_refused_by_name_without_images_on(tmp_path):
  cfg = _config(tmp_path)
  text_model = dataclasses.replace(cfg, model=dataclasses.replace(MODEL, vision=VisionConfig()))
  with pytest.raises(ConfigError, match=r"data.tiles_per_row=2 feeds images to a model without a vision tower"):
    sft_job(text_model, TOK)
  with pytest.raises(ConfigError, match=r"data.tiles_per_row=2: the tokenizer encodes '<image>' as 7 tokens"):
    sft_job(dataclasses.replace(cfg, model=dataclasses.replace(MODEL, vocab_size=400)), ByteTokenizer())
  with pytest.raises(RecordError, match=r"colours.jsonl:\d+: field 'messages' holds content parts, which need images "
                                        r"on: data.tiles_per_row > 0"):
    streams.supervised(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tiles_per_row=0)), TOK,
                       out=tmp_path)
  # Two tiles per edge: each 16-pixel image becomes 2 x 2 tiles and its global one, more than the 2 of a row.
  with pytest.raises(NoDataError, match=r"colours.jsonl:\d+: 5 image tiles, more than a row's data.tiles_per_row=2"):
    streams.supervised(_config(tmp_path, image_tiles_per_edge=2), TOK, out=tmp_path)
