from auto_research.cli import main

if __name__ == "__main__":  # vLLM's tensor-parallel workers are spawned: they import this module and run nothing
    raise SystemExit(main())
