"""Command-line entry point: ``python -m app {fit,validate,test,predict,analyze,bench}``."""
