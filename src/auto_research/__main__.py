from auto_research.cli import main

raise SystemExit(main())
