"""The RL trainer: algorithms, engines, runtime and tasks. Never imports Prefect, MLflow or SQL."""
