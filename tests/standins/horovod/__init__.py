"""Stand-in for the `horovod` package (tests/standins/README.md): only `horovod.torch` is provided."""
