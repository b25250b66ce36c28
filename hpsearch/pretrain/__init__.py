"""`python -m hpsearch.pretrain`: pretrain a T5 backbone with T5's span corruption, without a hub.

    python -m hpsearch.pretrain [--config FILE.yaml] [--local] [--resume-from DIR] [--tracking-uri URI]
                                [key=value ...]

The fine-tuning recipe's loop (Ray Train workers running DeepSpeed, checkpoints, resume, progress with ETA) with
another objective: `objective.SpanCorruption` on a text corpus (`corpus.py`: a folder of .txt / .jsonl, or the
suite's training inputs; never validation or test rows), noise from `spans.py`. The result is
`<train.output_dir>/backbone`, a T5 checkpoint with its tokenizer that `model.backbone=<dir>` fine-tunes. One MLflow
run (experiment `hpsearch/pretrain`) gets the config, every evaluation's metrics and the loss curve (`loss.png`).
"""
