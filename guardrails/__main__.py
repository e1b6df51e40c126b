from guardrails.cli import main

raise SystemExit(main())
