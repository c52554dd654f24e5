"""The model as the pipeline holds it, one decoder layer at a time: safetensors read tensor by
tensor, the merged weights as a lazy map, routed experts stacked, and the streamed transformers
model over them."""
