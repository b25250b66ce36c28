"""The search: `python -m hpsearch.tune`. The one place that knows Ray Tune and Optuna (MLflow: hpsearch.tracking).

- `space`: a search space in memory; Optuna's define-by-run function; a trial's run config
- `spacefile`: search-space files (`search_spaces/*.yaml`), read and validated completely
- `study`: a study's folder, the trial (a Tune function trainable launching the training recipe's Ray Train trainer),
  the Tuner (OptunaSearch TPE + ASHA), resume
- `searcher`: OptunaSearch that records ASHA-stopped trials as pruned
- `trialruns`: the Tune callback giving each trial its MLflow child run (the runs themselves: hpsearch.tracking)
- `report`: best trial, trial table, Pareto front, importances, plots
- `prepare`: everything a study needs, validated before Ray or MLflow start; study names (the next free one, the
  newest) and the claim that keeps two starts from sharing one (shared with hpsearch.compare)
- `cli`: the command line: the run, its end and its report
"""
