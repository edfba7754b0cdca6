"""The machinery behind train.py, eval/ and scripts/, one module a job."""
