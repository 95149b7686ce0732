from specviz.render.figures import main

raise SystemExit(main())
