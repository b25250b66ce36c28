from hpsearch.cli import run_main
from hpsearch.compare.cli import main

if __name__ == "__main__":
    run_main(main)
