from specviz.checks.identity import main

raise SystemExit(main())
