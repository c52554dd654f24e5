"""Proving a checkpoint sound before anyone registers it: its files (``structure``), an independent
reader's reload (``reader``), behaviour against the BF16 merged model (``parity``), the share of the
adapter's change that survived (``retention``), the recipe's bar (``gate``), and the report in
words (``report``, torch-free); ``stage`` runs them all as the pipeline's validation stage."""
