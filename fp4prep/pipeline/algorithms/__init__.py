"""The recipe's algorithms on one decoder layer: AWQ's scale search, folding the scales away, GPTQ,
and ``LayerPass``, which runs a recipe's steps on each layer ModelOpt calibrates."""
