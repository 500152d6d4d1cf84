"""headbench: ``python -m app {fit,validate,test,predict,analyze,bench,convert,demo}`` (app/main.py)."""
