"""An example rnn-harness backend, registered through the ``rnn_harness.backends`` entry point."""
