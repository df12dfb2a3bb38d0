"""Built-in trainers: ``trainer_fn``s the replica entrypoint can call (``diloco launch --trainer MODULE:FN``).

* ``diloco.trainers.hf:train``: a Hugging Face causal LM (``AutoModelForCausalLM``, by hub name, local path, or a
  fresh model from a config dict) on the user's own text/JSONL/Parquet files, local or under an ``s3://`` prefix.
  Needs the ``hf`` extra (``pip install 'diloco[hf]'``).
* ``diloco.trainers.gpt:diloco_train`` (the default, outside this package for now): the byte-level toy GPT on the
  Python standard library's source, which proves the mechanics without any download.

Importing this package imports nothing heavy: each trainer imports torch/transformers inside its function, so the
launcher can read a trainer's signature and preflight hook on a machine without them.
"""
