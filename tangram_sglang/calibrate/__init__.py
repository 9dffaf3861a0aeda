"""Offline calibration of budget profiles (a leaf: serving code never imports it).

``cli.py`` (argparse + tqdm), ``data.py`` (packaged ShareGPT / RULER SQuAD / JSONL samples),
``observe.py`` (HF model forward + scorer + per-request dynamic allocation -> retention),
``fit.py`` (mean + alpha*std, stability report), ``plots.py`` and ``show.py``
(``python -m tangram_sglang.profile show PROFILE --plot out.png``).
"""
