"""A package, so that its test modules (test_config.py, test_openai_batch.py) import as reader.test_config and
reader.test_openai_batch beside tests/engines/test_config.py and tests/scenarios/test_openai_batch.py."""
