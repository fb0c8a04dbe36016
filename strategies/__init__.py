"""TensorFlow-facing strategies (to come): a gradient aggregator for custom training loops that
buckets each layer's gradients and all-reduces them while backprop continues, Horovod-style
`broadcast_variables`, and TF-tensor collectives. TensorFlow is imported lazily, only here.
"""
