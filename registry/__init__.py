"""Projects, API keys, the credit ledger, the model registry and the supported-base catalogue (a Django app)."""
