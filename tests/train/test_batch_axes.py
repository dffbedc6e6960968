"""fit refuses a batch that does not split over the mesh axes the batch is sharded on, the `expert` axis included."""

import dataclasses

import pytest

from ptx.config import Config, DataConfig, MeshConfig
from ptx.data.tokenizer import ByteTokenizer
from ptx.model_config import MODEL_PRESETS, MoeConfig
from ptx.train.job import sft_job
from ptx.train.loop import fit


def test_a_batch_must_split_over_data_fsdp_and_expert(tmp_path):
  model = dataclasses.replace(MODEL_PRESETS["tiny"](), moe=MoeConfig(n_experts=8, experts_per_token=2,
                                                                     expert_mlp_dim=16))
  # 4 rows split over fsdp 2 but not over fsdp 2 x expert 4: refused before anything is built or compiled.
  cfg = Config(model=model, mesh=MeshConfig(fsdp=2, expert=4), data=DataConfig(batch_size=4, seq_len=16))
  with pytest.raises(ValueError, match=r"batch_size=4 does not split over the 8 devices .*mesh.expert = 4"):
    fit(cfg, sft_job(cfg, ByteTokenizer()), train_data=iter(()), out=tmp_path, progress=False)
