"""Prefect flows of asyncrl. Importing any of them configures Prefect, MLflow and Ray
first (:mod:`flows.environment`)."""

from flows.environment import configure

configure()
