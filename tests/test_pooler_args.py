"""``--pooler``: auto reads a sentence-transformers checkpoint's pooling config, else pools the last token."""

from __future__ import annotations

import argparse
import json
import logging

import pytest

from services.config.cli_args import add_engine_args
from services.config.engine_args import EngineArgs
from services.config.pooler import resolve_pooler


def sentence_transformers_folder(tmp_path, **modes):
    (tmp_path / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                },
            ]
        )
    )
    (tmp_path / "1_Pooling").mkdir()
    config = {"word_embedding_dimension": 1024, "pooling_mode_cls_token": False} | modes
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_auto_without_a_pooling_config_is_the_last_token(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        assert resolve_pooler("auto", tmp_path) == "last"
    assert "Embeddings pooler: last" in caplog.text


@pytest.mark.parametrize(
    ("flag", "pooler"), [("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean")]
)
def test_auto_reads_a_sentence_transformers_checkpoint(tmp_path, caplog, flag, pooler):
    folder = sentence_transformers_folder(tmp_path, **{flag: True})
    with caplog.at_level(logging.INFO):
        assert resolve_pooler("auto", folder) == pooler
    assert "1_Pooling" in caplog.text


def test_a_pooling_weft_does_not_serve_is_refused_under_auto(tmp_path):
    folder = sentence_transformers_folder(tmp_path, pooling_mode_cls_token=True)
    with pytest.raises(ValueError, match="--pooler"):
        resolve_pooler("auto", folder)
    assert resolve_pooler("mean", folder) == "mean"  # the flag overrides the checkpoint


def test_a_bad_value_is_refused(tmp_path):
    with pytest.raises(ValueError, match="pooler"):
        resolve_pooler("cls", tmp_path)


def test_the_flag_reaches_the_engine_config_with_the_hidden_size(default_model):
    config = EngineArgs(pooler="mean").create_engine_config()
    assert config.model.pooler == "mean"
    assert config.model.hidden_size == default_model.hf_config()["hidden_size"]
    assert EngineArgs().create_engine_config().model.pooler == "last"


def test_help_shows_the_flag_and_its_default():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).pooler == "auto"
    assert "--pooler" in parser.format_help()
