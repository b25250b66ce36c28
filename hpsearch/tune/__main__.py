from hpsearch.cli import run_main
from hpsearch.tune.cli import main

if __name__ == "__main__":
    run_main(main)
