"""The comparison: `python -m hpsearch.compare`. Which method wins on these tasks, by how much, at what cost?

Methods x seeds run as one Ray Tune grid, each trial the training recipe's Train V2 trainer (the same trial
as a study's, so it scales out the same way), tracked in MLflow as one parent run with a child per (method, seed).

- `spec`: the comparison spec (`search_spaces/compare-*.yaml`), read and validated completely before Ray starts
- `fromstudy`: each method's best configuration from a finished study (`--from-study`)
- `probe`: after training, in the trial: generation time and attention statistics of the exported model
- `run`: the comparison's folder, the trial, the Tuner (a grid), the MLflow child runs, the results
- `stats`: mean and 95 % interval over seeds (Student-t or bootstrap), paired differences
- `table`: the table (scores, extra parameters, cost ratios, paired comparisons) as Markdown, CSV and PNG
- `plots`: attention on prompts and token entropy per layer (the paper's Fig. 3), score vs a swept field (Fig. 4)
- `cli`: the command line
"""
