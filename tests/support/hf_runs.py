"""A tiny real run of the Hugging Face trainer, built offline, for the tests of what follows a run: ``collect --hf``
and ``diloco eval``. A byte-level BPE tokenizer trained here on a tiny grammar, a 2-layer Llama from a config,
2 local replicas for 2 rounds of 2 steps through the real CLI (in this process, so each test pays one CLI start).
Also a tiny lm-eval multiple-choice task over the same grammar, as a YAML file and a local JSONL dataset: lm-eval
runs it without the Hub."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner

SUBJECTS = ["the cat", "a dog", "the bird", "my friend"]
VERBS = ["sees", "likes", "finds", "helps"]
OBJECTS = ["the ball", "a tree", "the river", "some bread"]
#: ~100k parameters: 2 layers of width 64, a 300-token vocabulary, untied embeddings.
MODEL_CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
TASK = "tiny_grammar"
#: The task's documents: a context and two continuations, the first in the grammar, the second not.
TASK_DOCS = [{"context": f"{s} {v}", "choices": [f" {o}.", " purple seven of."], "label": 0}
             for s, v, o in zip(SUBJECTS, VERBS, OBJECTS, strict=True)]


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}." for _ in range(4))
            for _ in range(n)]


def make_tokenizer(directory: Path) -> Path:
    """A byte-level BPE tokenizer trained on the grammar's text, saved as a transformers tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sentences(200, seed=99), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(directory)
    return directory


def launch_tiny_hf_run(root: Path, *flags: str) -> str:
    """Launch (and wait for) the tiny run with DILOCO_HOME already set; its run id. ``flags`` go to launch."""
    from diloco.cli.main import app

    corpus = root / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    (corpus / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in sentences(160, seed=1)))
    kwargs = {"model_config": MODEL_CONFIG, "tokenizer": str(make_tokenizer(root / "tokenizer")),
              "data": str(corpus), "block_size": 32, "batch_size": 8, "lr": 3e-3, "warmup_steps": 1,
              "eval_batches": 1, "seed": 7}
    args = ["launch", "--replicas", "2", "--backend", "local", "--trainer", "diloco.trainers.hf:train",
            "--steps", "4", "--sync-every", "2", "-o", "json", *flags]
    for key, value in kwargs.items():
        args += ["-k", f"{key}={json.dumps(value)}"]
    launched = CliRunner().invoke(app, args)
    assert launched.exit_code == 0, launched.output
    return str(json.loads(launched.stdout)["run_id"])


def write_task(directory: Path) -> Path:
    """The tiny multiple-choice task: ``<directory>/tiny_grammar.yaml`` over ``<directory>/docs.jsonl``."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in TASK_DOCS))
    (directory / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return directory


def tiny_hf_environment(root: Path) -> dict[str, str]:
    """What a run under ``root`` and the tests that read it need set: DILOCO_HOME, W&B offline into
    ``root/wandb``, the Hub and datasets offline."""
    return {"DILOCO_HOME": str(root / "home"), "WANDB_MODE": "offline", "WANDB_DIR": str(root / "wandb"),
            "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(root / "datasets")}


@dataclass(frozen=True)
class TinyHfRun:
    """One finished tiny run of the Hugging Face trainer with a W&B run in offline mode."""

    root: Path
    run_id: str
