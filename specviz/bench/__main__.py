from specviz.bench.e2e import main

raise SystemExit(main())
