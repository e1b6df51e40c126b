from guardrails.cli.main import main

raise SystemExit(main())
