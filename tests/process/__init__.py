"""Tests that start processes: worker fleets, chaos, the llama.cpp server, a live Airflow deployment, Chromium."""
