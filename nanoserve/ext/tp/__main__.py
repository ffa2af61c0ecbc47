"""`python -m nanoserve.ext.tp`: a worker rank that rank 0 started (workers.py), which serves rank 0's steps until it
says stop."""

from nanoserve.ext.tp.workers import run_started_worker

run_started_worker()
