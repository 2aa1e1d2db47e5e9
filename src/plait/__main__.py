from plait.cli.main import main

raise SystemExit(main())
